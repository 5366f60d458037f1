"""The same forward over a device mesh: tensor-parallel over heads and MLP columns, data-parallel
over the batch. GSPMD does the partitioning; there is no second model implementation.

A layout is a `jax.sharding.Mesh` with axes ("data", "model"). Params and caches are placed with
`NamedSharding`s built here, and the jitted forward in engine.py compiles for whatever shardings
its inputs carry. Megatron-style placement: Q/K/V, gate and up are split by output columns, O and
down by input rows, the unembedding by vocabulary; norms and the embedding table are replicated.
A dimension that the axis size does not divide is replicated instead (correct, just not split).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsmol.errors import JaxsmolError


def make_mesh(tp: int = 1, dp: int = 1) -> Mesh:
    """A ("data", "model") mesh over the first dp * tp devices."""
    if tp < 1 or dp < 1:
        raise JaxsmolError(f"mesh sizes must be >= 1, got tp={tp}, dp={dp}")
    devices = jax.devices()
    if tp * dp > len(devices):
        raise JaxsmolError(f"a mesh of dp={dp} x tp={tp} needs {tp * dp} devices, but only {len(devices)} are "
                           "visible (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    return Mesh(np.array(devices[: tp * dp]).reshape(dp, tp), ("data", "model"))


def describe(mesh: Mesh | None) -> str:
    return "single" if mesh is None else f"dp{mesh.shape['data']}xtp{mesh.shape['model']}"


def _spec(mesh: Mesh, shape, axes) -> NamedSharding:
    """axes[i] names the mesh axis for dim i (or None); dropped where it does not divide the dim."""
    fitted = [a if a is not None and shape[i] % mesh.shape[a] == 0 else None for i, a in enumerate(axes)]
    return NamedSharding(mesh, P(*fitted))


# per LayerParams field: mesh axis of each dim (the stacked layers' [L] first)
_LAYER_AXES = {
    "attn_norm": (None, None), "mlp_norm": (None, None),
    "wq": (None, None, "model"), "wk": (None, None, "model"), "wv": (None, None, "model"),
    "wo": (None, "model", None),
    "w_gate": (None, None, "model"), "w_up": (None, None, "model"),
    "w_down": (None, "model", None),
}


def shard_params(params, mesh: Mesh):
    """Place params on the mesh (see the module docstring)."""
    stacked = params.layers
    layers = stacked.replace(**{name: jax.device_put(getattr(stacked, name),
                                                     _spec(mesh, getattr(stacked, name).shape, axes))
                                for name, axes in _LAYER_AXES.items()})
    return params.replace(
        embed=jax.device_put(params.embed, _spec(mesh, params.embed.shape, (None, None))),
        final_norm=jax.device_put(params.final_norm, _spec(mesh, params.final_norm.shape, (None,))),
        unembed=jax.device_put(params.unembed, _spec(mesh, params.unembed.shape, (None, "model"))),
        layers=layers)


def kv_sharding(mesh: Mesh, shape) -> NamedSharding:
    """k, v [L, B, K, S, H]: batch over "data", kv heads over "model"."""
    return _spec(mesh, shape, (None, "data", "model", None, None))
