"""Where the slots are in a KV array ([L, B, K, S, H]: kv.py's legend), for code that slices them without
the KV pytree itself (a snapshot file's reader: `jaxsmol cache ls` imports no jax)."""

SEQ_AXIS = 3  # the slot axis of k and v


def seq_index(start: int | None = None, stop: int | None = None) -> tuple:
    """The index of slots [start, stop) of a k or v array (device or host): a[seq_index(0, n)]."""
    return (slice(None),) * SEQ_AXIS + (slice(start, stop),)
