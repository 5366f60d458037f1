"""Where prefixes are kept, knowing nothing of models (a value is a pytree of host arrays sharing a
sequence axis): the radix tree (radix.py; its nodes and matches in nodes.py, its pinned keys in
pinned_keys.py), one snapshot as one safetensors file (snapshot.py), the disk tier of such files
(disk.py), and helpers on keys and values (values.py). Imports: jaxsmol (errors, durable writes, kv) only.

PrefixCache holds one `RadixStore` (many keys; `max_keys=1`: the single snapshot) and uses:

    lookup(ns, tokens, gather=True, count=True) -> Match   the longest stored prefix: `length` tokens found,
                                  `reused` positions to restore and their `value`, `payload` on an exact
                                  full hit; held until release(match) (gather=False: the value read
                                  later, by gather(match, match.reused); count=False: not a request's hit)
    peek(ns, tokens) -> int       how many leading tokens are stored (nothing gathered, held or touched)
    insert(ns, tokens, value_of, payload=None) -> positions newly stored
    state(ns, tokens) -> (tokens, value, {length: payload}) of the longest stored prefix, or None
    add(ns, tokens, value_of, payloads)   store a key and an exact entry per payload (files, disk)
    entries() -> [(ns, tokens)]   every stored key, least recently used first
    pin / unpin / pin_cost, walk(), clear(), bytes_held, pinned_bytes, evictions
"""
