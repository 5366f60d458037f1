"""Where prefixes are kept, knowing nothing of models (a value is a pytree of host arrays sharing a
sequence axis): the interface PrefixCache holds a store by (interface.py), the radix tree of many keys
(radix.py), the course exercise's single snapshot (minimal.py), one snapshot as one safetensors file
(snapshot.py), the disk tier of such files (disk.py), and helpers on keys and values (values.py).
Imports: jaxsmol (errors, durable writes, kv) only."""

from jaxsmol.cache.store.interface import Hit, RadixPrefixStore

__all__ = ["Hit", "RadixPrefixStore"]
