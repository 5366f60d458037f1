"""Every layer's weights stacked into one array a field ([L, ...]), and back: the layout in which one
compiled decoder layer, looped over the layer index, reads layer i of each weight in place
(model/forward.py; the C++ kernels take the layer as an operand)."""

from __future__ import annotations

import jax
import numpy as np


def stack_layers(layer_at, n: int):
    """One pytree whose leaves are the n layers' stacked ([L, ...]), from layer_at(i), the pytree of layer
    i: each layer is copied into 64-byte aligned host buffers as it comes, which the device arrays then
    alias on the CPU (a load's peak is the weights once, plus one layer, not twice the weights)."""
    buffers, treedef = None, None
    for i in range(n):
        leaves, treedef = jax.tree.flatten(layer_at(i))
        if buffers is None:
            buffers = [_aligned_empty((n, *np.shape(a)), a.dtype) for a in leaves]
        for buffer, a in zip(buffers, leaves):
            buffer[i] = np.asarray(a)
    return jax.tree.unflatten(treedef, [jax.device_put(b, may_alias=True) for b in buffers])


def _aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialized array at a 64-byte boundary: what XLA's CPU client takes without a copy."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(n + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + n].view(dtype).reshape(shape)


def unstack_layers(stacked) -> list:
    """stack_layers' inverse: the pytree of layer i for each i (copies)."""
    return [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(jax.tree.leaves(stacked)[0].shape[0])]
