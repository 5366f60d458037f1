"""A GGUF file run as it is: its Q8_0, Q4_1 and Q4_0 matrices read block by block into the kernels'
formats (kernels/formats.py: Q4_0's d (q - 8) is Q4_1 with m = -8 d, exactly), its float tensors
(F32, F16, BF16) as float32, and the directory beside it that holds its config and tokenizer
(gguf_import.py, once per file, under the data directory). A file run as it is gets a lean import,
NAME-KEY.lean: config, tokenizer, and only its float tensors (the norms: 0.4 MB on a 1.7B model); its
quantized tensors are read from the file. The full import, NAME-KEY (every tensor as float32: 6.4 GB
on a 1.7B), is made only for what needs every float value: --quantize none|q8_0|q4_1 and float files."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from jaxsmol.checkpoint.gguf_import import FLOAT_TYPES as FLOAT
from jaxsmol.checkpoint.gguf_import import dequantize, hf_name, import_once, open_gguf, unpermute_qk
from jaxsmol.errors import JaxsmolError
from jaxsmol.kernels import formats
from jaxsmol.model.params import Checkpoint
from jaxsmol.system.data_dirs import models_dir

NATIVE = {"Q8_0": "q8_0", "Q4_1": "q4_1", "Q4_0": "q4_1"}  # GGUF type -> the format it runs in
_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_BLOCK_BYTES = {"Q8_0": 34, "Q4_1": 20, "Q4_0": 18}  # float16 d (and m), then 32 codes


def is_gguf(path: str | Path) -> bool:
    """A .gguf name, or GGUF's magic in the first four bytes (only those are read)."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def imported_dir(gguf_path: Path, progress: bool = True, lean: bool = False) -> Path:
    """The HF directory of this file (config, tokenizer, float32 tensors), imported on first use (the
    bundled model's file: the default model's directory). lean: only the tensors the file stores as
    floats, in a directory of its own (NAME-KEY.lean), so that it is never taken for the full import
    (NAME-KEY, named as before: one made before lean imports existed is the full import still)."""
    from jaxsmol.checkpoint import default_model

    try:
        if gguf_path.resolve() == default_model.bundled_gguf_path().resolve():
            return default_model.default_model_dir(progress, lean)
    except JaxsmolError:  # the bundled model is not installed: this is another file
        pass
    st = gguf_path.stat()
    key = hashlib.blake2b(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode(), digest_size=6).hexdigest()
    out = models_dir() / f"{gguf_path.stem}-{key}{'.lean' if lean else ''}"
    return import_once(gguf_path, out, progress=progress, floats_only=lean)


def file_format(reader, path: Path) -> str | None:
    """The format a file's layer matrices run in: None (all float), "q8_0" or "q4_1"; a JaxsmolError
    naming any type it cannot run as it is, and what to do."""
    types = {t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.")
             and t.name.split(".")[2] in _MATRICES}
    if types <= set(FLOAT):
        return None
    runs = {NATIVE.get(t) for t in types}
    if None in runs or len(runs) > 1 or types & set(FLOAT):
        other = sorted(t for t in types if t not in NATIVE) or sorted(types)
        raise JaxsmolError(
            f"{path.name} holds matrices of type {', '.join(other)}: jaxsmol runs F32, F16, BF16, Q8_0, Q4_1 and "
            "Q4_0 files as they are (one quantized type for the layers). Convert it with llama.cpp's llama-quantize "
            "to Q8_0 or Q4_1, or pass --quantize q8_0|q4_1 to run it requantized from its float values")
    return runs.pop()


def blocks(t, heads: int | None = None) -> formats.QuantizedMatrix:
    """One Q8_0 / Q4_1 / Q4_0 tensor [N, K] (GGUF rows) -> a QuantizedMatrix of w [K, N]. heads: q's or
    k's head count, whose rows llama.cpp permuted for its RoPE (unpermuted here, as rows)."""
    kind = t.tensor_type.name
    K, N = (int(d) for d in t.shape)  # GGUF lists dims fastest first
    raw = np.asarray(t.data, np.uint8).reshape(N, K // formats.BLOCK, _BLOCK_BYTES[kind])
    if heads:
        raw = unpermute_qk(raw, heads)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K / 32]
    if kind == "Q8_0":
        return formats.from_rows("q8_0", raw[..., 2:].copy().view(np.int8).reshape(N, K), d)
    qs = raw[..., 4:] if kind == "Q4_1" else raw[..., 2:]  # [N, K / 32, 16]: codes j and j + 16
    values = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(N, K)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else -8.0 * d
    return formats.from_rows("q4_1", values, d, m)


class GGUFFile:
    """A GGUF file opened to run: its imported directory and the format its matrices run in."""

    def __init__(self, path: Path, progress: bool = True, requantize: bool = False):
        """requantize: the caller quantizes the float import itself (--quantize), whatever the file's types."""
        if not is_gguf(path):
            raise JaxsmolError(f"{path} is a file, not a model directory or a .gguf file")
        self.path, self.reader = path, open_gguf(path, values=False)  # config and tokenizer: from the import
        # refuses what it cannot run before importing
        self.format = None if requantize else file_format(self.reader, path)
        self.model_dir = imported_dir(path, progress, lean=self.format is not None)

    def tensors(self, cfg) -> GGUFTensors:
        import json

        cfg_hf = json.loads((self.model_dir / "config.json").read_text())
        return GGUFTensors(self.reader, self.model_dir, cfg_hf, cfg.tie_embeddings)


class GGUFTensors:
    """The tensors params_from_hf reads, by HF name: a quantized matrix as its file's blocks, any
    other quantized tensor (an untied model's token table, a Q6_K one) dequantized from the file as
    the full import would (gguf_import.dequantize: the same float32 values), and the float tensors
    from the imported directory (lean or full). Names and shapes of the file's quantized tensors come
    from its header (HF's [out, in]: GGUF lists dims fastest first)."""

    def __init__(self, reader, model_dir: Path, cfg_hf: dict, tied: bool):
        self.floats = Checkpoint(model_dir)
        self.cfg_hf, self.tied = cfg_hf, tied
        self.in_file = {hf_name(t.name): t for t in reader.tensors if t.tensor_type.name not in FLOAT}
        self.quantized = {name: t for name, t in self.in_file.items() if t.tensor_type.name in NATIVE
                          and (t.name.startswith("blk.") or tied or t.name == "output.weight")}

    def keys(self):
        return self.floats.keys() | self.in_file.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        t = self.in_file.get(name)
        return self.floats.shape(name) if t is None else tuple(int(d) for d in reversed(t.shape))

    def __getitem__(self, name: str):
        t = self.in_file.get(name)
        if t is None:
            return self.floats[name]
        if name not in self.quantized or not t.name.endswith("weight") or len(t.shape) != 2:
            return dequantize(t, self.cfg_hf)
        heads = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}.get(t.name.split(".")[-2])
        return blocks(t, self.cfg_hf[heads] if heads else None)
