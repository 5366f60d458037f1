"""Save a Llama checkpoint as a GGUF file that jaxsmol runs as it is and llama.cpp loads
(`jaxsmol quantize DIR OUT.gguf --type q8_0|q4_1|f32`).

The file is laid out as llama.cpp's converter (convert_hf_to_gguf.py) lays out a Llama: arch "llama",
the llama.* hyperparameters, tensors token_embd / blk.N.attn_q ... / output_norm (/ output when
untied), attn_q and attn_k rows permuted for llama.cpp's RoPE (gguf_import.permute_qk), and the
byte-level BPE tokenizer as tokenizer.ggml.* (model "gpt2"). gguf_import.py reads all of it back.

The values are those of `Engine.load(DIR, quantize=TYPE)`: every layer matrix quantized by
kernels/formats.quantize (ggml's reference rounding), the tied token table or the untied lm_head at
formats.UNEMBED_FORMAT (Q8_0, as the bundled file), written as GGUF blocks. `Engine.load(OUT)` reads
those blocks back (gguf_weights.py): the same weights, so the same logits bit for bit. An untied
model's token_embd stays F32 (jaxsmol gathers its rows in float32), as do the norms; `f32` writes
every tensor F32 (the logits of `Engine.load(DIR)`).

Tensors are read, quantized and written one at a time (their infos are known from the config up
front), into OUT.PID.tmp beside OUT, fsynced, then renamed to OUT.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np

from jaxsmol.checkpoint.gguf_import import GLOBAL_NAMES, LAYER_NAMES, pre_tokenizer, permute_qk
from jaxsmol.errors import JaxsmolError
from jaxsmol.kernels import formats
from jaxsmol.model.config import Config
from jaxsmol.model.params import Checkpoint, expected_shapes
from jaxsmol.system.durable import fsync_dir
from jaxsmol.system.progress import Wait

TYPES = ("q8_0", "q4_1", "f32")
_GGML = {"q8_0": "Q8_0", "q4_1": "Q4_1", "f32": "F32"}  # gguf.GGMLQuantizationType names
_FILE_TYPE = {"q8_0": "MOSTLY_Q8_0", "q4_1": "MOSTLY_Q4_1", "f32": "ALL_F32"}  # gguf.LlamaFileType names
_PRE = ("smollm", "gpt-2", "llama-bpe")  # tokenizer.ggml.pre values whose tokenizer.json gguf_import rebuilds
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5  # llama.cpp token types
_CHUNK_ROWS = 8192  # rows quantized at a time (a multiple of formats.PANEL): bounds the temporaries
_LAYER_ORDER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                "ffn_down")


def _source_dir(src: Path, progress: bool) -> Path:
    """The HF directory to read: `src` itself, or the float32 import of a GGUF file (what
    `Engine.load(FILE, quantize=...)` quantizes)."""
    if src.is_dir():
        return src
    if not src.exists():
        raise JaxsmolError(f"model directory {src} does not exist")
    from jaxsmol.checkpoint.gguf_weights import GGUFFile

    return GGUFFile(src, progress, requantize=True).model_dir


def tensor_plan(cfg: Config, qtype: str) -> list[tuple[str, str, str, int | None]]:
    """(GGUF name, HF name, type in TYPES, heads whose rows to permute or None), in the file's order."""
    table = "f32" if qtype == "f32" else formats.UNEMBED_FORMAT
    plan = [("token_embd.weight", "model.embed_tokens.weight", table if cfg.tie_embeddings else "f32", None)]
    for i in range(cfg.n_layers):
        for g in _LAYER_ORDER:
            kind = "f32" if g.endswith("norm") else qtype
            heads = {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads}.get(g)
            plan.append((f"blk.{i}.{g}.weight", f"model.layers.{i}.{LAYER_NAMES[g]}.weight", kind, heads))
    plan.append(("output_norm.weight", GLOBAL_NAMES["output_norm.weight"], "f32", None))
    if not cfg.tie_embeddings:
        plan.append(("output.weight", "lm_head.weight", table, None))
    return plan


def row_blocks(w: formats.QuantizedMatrix) -> np.ndarray:
    """A QuantizedMatrix of w [K, N] -> GGUF's blocks of its N rows, uint8 [N, K / 32, 34 (Q8_0) or 20
    (Q4_1)]: float16 d (Q4_1: then float16 m), then the codes (Q4_1: byte j holds k = j and j + 16)."""
    P, K, _ = w.shape
    N, KB = P * formats.PANEL, K // formats.BLOCK
    panels = np.asarray(w.q)  # [P, K, 32] int8, or [P, K, 16] uint8 (columns j and j + 16)
    if w.fmt == "q4_1":
        panels = np.concatenate([panels & 0xF, panels >> 4], axis=-1)
    codes = panels.transpose(0, 2, 1).reshape(N, KB, formats.BLOCK)  # row n, block b, its 32 k's
    scale = lambda a: np.asarray(a).transpose(0, 2, 1).reshape(N, KB, 1).astype(np.float16).view(np.uint8)  # noqa: E731
    if w.fmt == "q8_0":
        return np.concatenate([scale(w.d), codes.astype(np.int8).view(np.uint8)], axis=-1)
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    return np.concatenate([scale(w.d), scale(w.m), qs], axis=-1)


def tensor_data(a: np.ndarray, kind: str, heads: int | None) -> np.ndarray:
    """One HF tensor ([D], or [N, K] as nn.Linear stores it) as the bytes the file holds: float32 of
    the same shape, or uint8 [N, K / 32 * block bytes]; q and k rows permuted (heads)."""
    a = np.asarray(a, np.float32)
    if kind == "f32":
        return np.ascontiguousarray(permute_qk(a, heads) if heads else a)
    N = a.shape[0]  # formats.quantize takes [K, N]: the same blocks Engine.load(DIR, quantize=kind) makes
    raw = np.concatenate([row_blocks(formats.quantize(a[r:r + _CHUNK_ROWS].T, kind))
                          for r in range(0, N, _CHUNK_ROWS)])
    return np.ascontiguousarray(permute_qk(raw, heads) if heads else raw).reshape(N, -1)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise JaxsmolError(f"cannot read {path}: {e}") from None


def tokenizer_fields(model_dir: Path, cfg_hf: dict, vocab_size: int) -> dict:
    """The tokenizer.ggml.* values, as the converter derives them from tokenizer.json and
    tokenizer_config.json: tokens and types for ids 0..vocab_size-1, merges, pre, special ids, add_bos,
    chat_template. Only byte-level BPE tokenizers whose pre-tokenizer llama.cpp names are written."""
    if not (model_dir / "tokenizer.json").is_file():
        raise JaxsmolError(f"model directory {model_dir} has no tokenizer.json")
    tj = _read_json(model_dir / "tokenizer.json")
    tc = _read_json(model_dir / "tokenizer_config.json") if (model_dir / "tokenizer_config.json").is_file() else {}
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or tj.get("normalizer") or (tj.get("decoder") or {}).get("type") != "ByteLevel":
        raise JaxsmolError(f"{model_dir}/tokenizer.json is not a byte-level BPE tokenizer (GGUF's 'gpt2' model)")
    pre = next((p for p in _PRE if pre_tokenizer(p) == tj.get("pre_tokenizer")), None)
    if pre is None:
        raise JaxsmolError(f"{model_dir}/tokenizer.json has a pre-tokenizer llama.cpp does not name "
                           f"(supported: {', '.join(_PRE)})")
    added = {int(t["id"]): t for t in tj.get("added_tokens", [])}
    by_id = {int(i): t for t, i in model["vocab"].items()} | {i: t["content"] for i, t in added.items()}
    if max(by_id) >= vocab_size:
        raise JaxsmolError(f"the tokenizer has token id {max(by_id)}, beyond the model's vocab_size {vocab_size}")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    looks_special = lambda t: t.startswith("<|") and t.endswith("|>")  # noqa: E731  (the converter's test)
    types = [_UNUSED if i not in by_id else _NORMAL if i not in added else
             _CONTROL if added[i].get("special") or looks_special(tokens[i]) else _USER_DEFINED
             for i in range(vocab_size)]
    ids_of = {t: i for i, t in by_id.items()}
    special = {}
    for kind in ("bos", "eos", "unk", "pad"):  # tokenizer_config.json's token, else config.json's id
        name = tc.get(f"{kind}_token")
        i = ids_of.get(name.get("content") if isinstance(name, dict) else name)
        i = cfg_hf.get(f"{kind}_token_id") if i is None else i
        i = i[0] if isinstance(i, list) and i else i
        if isinstance(i, int) and 0 <= i < vocab_size:
            special[kind] = i
    template = tc.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return {"tokens": tokens, "types": types, "merges": merges, "pre": pre, "special": special,
            "add_bos": bool(tc.get("add_bos_token", False)), "chat_template": template}


def _add_metadata(w, cfg: Config, qtype: str, name: str, tok: dict) -> None:
    """The general.*, llama.* and tokenizer.* keys llama.cpp's converter writes for a Llama."""
    import gguf

    w.add_type("model")
    w.add_name(name)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_file_type(gguf.LlamaFileType[_FILE_TYPE[qtype]])
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    for kind, i in tok["special"].items():
        getattr(w, f"add_{kind}_token_id")(i)
    w.add_add_bos_token(tok["add_bos"])
    if tok["chat_template"]:
        w.add_chat_template(tok["chat_template"])


def _add_tensor_infos(w, plan, shapes: dict) -> None:
    import gguf

    for gname, hf_name, kind, _ in plan:
        shape = shapes[hf_name]
        if kind == "f32":
            w.add_tensor_info(gname, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            raw = gguf.GGMLQuantizationType[_GGML[kind]]
            block, nbytes = gguf.GGML_QUANT_SIZES[raw]
            byte_shape = (shape[0], shape[1] // block * nbytes)
            w.add_tensor_info(gname, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=raw)


def _write(path: Path, ckpt: Checkpoint, cfg: Config, qtype: str, name: str, tok: dict, progress: bool) -> None:
    """Header, metadata and tensor infos, then each tensor read, converted and written in turn; fsynced."""
    import gguf

    plan = tensor_plan(cfg, qtype)
    w = gguf.GGUFWriter(path, "llama")
    _add_metadata(w, cfg, qtype, name, tok)
    _add_tensor_infos(w, plan, expected_shapes(cfg))
    try:
        w.write_header_to_file(path)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with Wait(f"writing {path.name} ({qtype})", total=len(plan), show=progress) as wait:
            for _, hf_name, kind, heads in plan:
                wait.advance()
                w.write_tensor_data(tensor_data(ckpt[hf_name], kind, heads))
        for f in w.fout:
            f.flush()
            os.fsync(f.fileno())
    finally:
        w.close()


def export_gguf(src: str | Path, out: str | Path, qtype: str = "q8_0", *, force: bool = False,
                progress: bool = True) -> Path:
    """Write the checkpoint directory (or GGUF file) `src` as the GGUF file `out` in `qtype` (TYPES);
    return `out`. JaxsmolError for an unknown type, a missing source, an `out` that exists (unless
    force), a model that is not a Llama or whose sizes the type cannot take."""
    src, out = Path(src), Path(out)
    if qtype not in TYPES:
        raise JaxsmolError(f"unknown --type {qtype!r}: one of {', '.join(TYPES)}")
    if out.is_dir() or (out.exists() and not force):
        raise JaxsmolError(f"{out} already exists" + ("" if out.is_dir() else " (pass --force to replace it)"))
    model_dir = _source_dir(src, progress)
    cfg = Config.load(model_dir)  # refuses a missing config.json and every architecture but LlamaForCausalLM
    if qtype != "f32":
        cfg.check_blocks(qtype, formats.BLOCK)  # Engine.load's refusal for --quantize
    ckpt = Checkpoint(model_dir)
    for hf_name, shape in expected_shapes(cfg).items():
        if hf_name not in ckpt.keys():
            raise JaxsmolError(f"checkpoint {model_dir} is missing tensor {hf_name}")
        if ckpt.shape(hf_name) != shape:
            raise JaxsmolError(f"tensor {hf_name} has shape {ckpt.shape(hf_name)}, expected {shape} from config.json")
    tok = tokenizer_fields(model_dir, _read_json(model_dir / "config.json"), cfg.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    try:
        _write(tmp, ckpt, cfg, qtype, src.stem if src.is_file() else src.resolve().name, tok, progress)
        if out.exists() and not force:  # another process wrote it meanwhile
            raise JaxsmolError(f"{out} already exists (pass --force to replace it)")
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(out.parent)
    return out
