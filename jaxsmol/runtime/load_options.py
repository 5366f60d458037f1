"""How Engine.load's options become the model's Config: the weights' format (quantize) and how the
kernels multiply quantized matrices (matmul), each refused with a JaxsmolError naming why."""

from __future__ import annotations

import dataclasses

from jaxsmol.errors import JaxsmolError
from jaxsmol.kernels import cpu_kernels, formats
from jaxsmol.model.config import Config


def with_quantization(cfg: Config, quantize: str | None, dtype: str, mesh) -> Config:
    """cfg with its weights' format, or a JaxsmolError saying why the model cannot take it."""
    if quantize is None:
        return cfg
    if quantize not in formats.FORMATS:
        raise JaxsmolError(f"quantize must be one of {', '.join(formats.FORMATS)}, got {quantize!r}")
    if dtype != "float32":
        raise JaxsmolError(f"quantized weights compute in float32: --quantize {quantize} takes --dtype float32")
    if mesh is not None:
        raise JaxsmolError("quantized weights run on one device: --quantize takes no mesh")
    cfg.check_blocks(quantize, formats.BLOCK)
    return dataclasses.replace(cfg, quant=quantize)


MATMULS = ("auto", "exact", "int8")  # Engine.load's matmul (--matmul)


def with_matmul(cfg: Config, matmul: str) -> Config:
    """cfg with its matmul class (Config.matmul) resolved from MATMULS: auto is int8 for quantized weights
    under the CPU kernels (faster on every row count measured, AVX2 and AVX-512: docs/performance.md),
    exact otherwise; a JaxsmolError where int8 cannot run. Call after cpu_kernels.configure."""
    if matmul not in MATMULS:
        raise JaxsmolError(f"matmul must be one of {', '.join(MATMULS)}, got {matmul!r}")
    if matmul == "auto":
        matmul = "int8" if cfg.quant and cfg.cpu_kernels else "exact"
    elif matmul == "int8" and not cfg.quant:
        raise JaxsmolError("--matmul int8 multiplies quantized weights: load a Q8_0 or Q4_1 GGUF file, or "
                           "pass --quantize q8_0 or q4_1")
    elif matmul == "int8" and not cfg.cpu_kernels:
        raise JaxsmolError("--matmul int8 runs on the CPU kernels, which this engine does not use "
                           f"({cpu_kernels.state().reason or 'a mesh, or not a CPU device'}; jaxsmol info says more)")
    return dataclasses.replace(cfg, matmul=matmul)
