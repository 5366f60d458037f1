"""Helpers on the store's keys and values: the common prefix of two token sequences, the bytes of a
value (a pytree of arrays), and copies that own their memory (so the bytes counted are the bytes held)."""

from __future__ import annotations

import numpy as np

from jaxsmol.system import host_memory


def common_prefix_len(a, b, start: int = 0) -> int:
    """How many leading items of `a` equal the items of `b` from index `start` on (the one common-prefix
    helper: the store's keys, its files' and the conversations'). Sequences of one type compare in C
    slices of halving length (a 2000-token edge: tens of microseconds, not a Python loop over every token)."""
    limit = min(len(a), len(b) - start)
    if type(a) is not type(b) or not isinstance(a, (tuple, list)):
        n = 0
        while n < limit and a[n] == b[start + n]:
            n += 1
        return n
    n = 0  # a[:n] == b[start:start + n]; find the first difference in ever shorter blocks
    step = limit
    while step:
        if n + step <= limit and a[n:n + step] == b[start + n:start + n + step]:
            n += step
        else:
            step //= 2
    return n


def tree_bytes(tree) -> int:
    """The bytes of a pytree's array leaves."""
    import jax  # here, not above: a snapshot file's reader (`jaxsmol cache ls`) needs no jax

    return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(tree))


def _own(a):
    """`a` if it owns its memory, else a copy with the same read-only flag: a view would keep its
    whole base alive while only the view's bytes are counted."""
    if not isinstance(a, np.ndarray) or host_memory.owns(a):
        return a
    out = host_memory.copy(a)  # a C-contiguous array that owns its buffer (a large one: pages of its own)
    out.flags.writeable = a.flags.writeable
    return out


def owned(tree):
    """`tree` with every NumPy view replaced by a copy that owns its memory (see _own)."""
    import jax

    return jax.tree.map(_own, tree)
