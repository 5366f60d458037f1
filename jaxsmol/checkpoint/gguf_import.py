"""Convert a Llama-architecture GGUF file (llama.cpp) into a standard Hugging Face model directory.

The output (`config.json`, float32 `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`,
`generation_config.json`) is what `transformers` would save for a `LlamaForCausalLM`, so the rest of
jaxsmol only ever reads one format. Quantized tensors are dequantized to float32 with `gguf`; with
`floats_only` (a file run as it is, gguf_weights.py) they are left out, the file itself read instead.

A GGUF file is untrusted input: every size in its metadata is checked against the tensors the file
really holds before anything is sized from it (`_check_sizes`). The output is written into a temporary
sibling directory (`.NAME.PID.*.tmp`), fsynced, and renamed into place; one left by an import that was
killed is removed by the next import into the same parent directory.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import struct
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxsmol.system.durable import fsync_dir
from jaxsmol.system.progress import Wait
from jaxsmol.errors import JaxsmolError

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types registered as added tokens
_MAX_CONTEXT = 1 << 21  # context_length backs no tensor: a sanity bound (Llama 3.1 has 131,072)
FLOAT_TYPES = ("F32", "F16", "BF16")

# Per-layer GGUF tensor name -> HF name.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}

# The regex of Meta-Llama-3's tokenizer.json Split pre-tokenizer (llama.cpp pre type "llama-bpe").
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row permutation of q_proj/k_proj (HF half-split RoPE -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_qk`: back to the HF row order that jaxsmol's RoPE expects."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(gguf_path: Path, values: bool = True):
    """The file read (gguf_read.py); a JaxsmolError for what is missing or not a GGUF file."""
    from jaxsmol.checkpoint.gguf_read import read_gguf

    if not gguf_path.exists():
        raise JaxsmolError(f"GGUF file not found: {gguf_path}")
    if not gguf_path.is_file():
        raise JaxsmolError(f"not a GGUF file (not a regular file): {gguf_path}")
    return read_gguf(gguf_path, values)


def _field(reader, key: str, default=None):
    v = reader.fields.get(key)
    return default if v is None else v


def _f32(x: float) -> float:
    """GGUF stores floats as float32: print the shortest decimal that round-trips (9.99e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _read_config(reader, path: Path) -> tuple[dict, dict]:
    """The HF config.json and the tokenizer metadata; refuse what the importer cannot represent."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise JaxsmolError(f"unsupported GGUF architecture {arch!r} in {path} (only 'llama' is supported)")

    def need(key):
        v = _field(reader, f"llama.{key}")
        if v is None:
            raise JaxsmolError(f"GGUF file {path} lacks metadata llama.{key}")
        return v

    dim, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_heads))
    if min(dim, n_heads, n_kv) <= 0 or n_heads % n_kv:
        raise JaxsmolError(f"GGUF file {path} has invalid sizes: embedding_length={dim}, head_count={n_heads}, "
                           f"head_count_kv={n_kv}")
    head_dim = int(_field(reader, "llama.attention.key_length", dim // n_heads))
    rot = int(_field(reader, "llama.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise JaxsmolError(f"unsupported GGUF: partial RoPE (rope.dimension_count={rot}, head_dim={head_dim})")
    scaling = _field(reader, "llama.rope.scaling.type", "none")
    if scaling not in ("none", "linear") or (scaling == "linear" and
                                              _field(reader, "llama.rope.scaling.factor", 1.0) != 1.0):
        raise JaxsmolError(f"unsupported GGUF: rope scaling {scaling!r}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise JaxsmolError(f"GGUF file {path} has no tokenizer (tokenizer.ggml.tokens)")
    names = {t.name for t in reader.tensors}
    ids = {k: _field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")}
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": int(_field(reader, "llama.vocab_size", len(tokens))),
        "hidden_size": dim, "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv, "head_dim": head_dim,
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["padding"],
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    }
    tok = {
        "model": _field(reader, "tokenizer.ggml.model"), "pre": _field(reader, "tokenizer.ggml.pre", "default"),
        "tokens": tokens, "types": _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens),
        "merges": _field(reader, "tokenizer.ggml.merges") or [], "ids": ids,
        "add_bos": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    if tok["model"] != "gpt2":
        raise JaxsmolError(f"unsupported GGUF tokenizer model {tok['model']!r} (only byte-level BPE 'gpt2')")
    return cfg, tok


def _check_sizes(reader, cfg: dict, path: Path) -> dict[str, tuple[int, ...]]:
    """The HF shapes the config implies, once every size in it is backed by the file's tensors (names
    and shapes of the tensors present, checked before any tensor data is read or anything allocated;
    a crafted block_count of 2^40 would otherwise be 9 x 2^40 expected names)."""
    L, ctx = cfg["num_hidden_layers"], cfg["max_position_embeddings"]
    n_tensors = 2 + 9 * L + (0 if cfg["tie_word_embeddings"] else 1)
    if L <= 0 or n_tensors != len(reader.tensors):
        raise JaxsmolError(f"GGUF file {path} declares block_count {L}, which its {len(reader.tensors)} tensors "
                           "do not match (a plain Llama block has 9)")
    if not 0 < ctx <= _MAX_CONTEXT:
        raise JaxsmolError(f"GGUF file {path} declares context_length {ctx}, outside [1, {_MAX_CONTEXT}]")
    sizes = {k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "head_dim")}
    if min(sizes.values()) <= 0:
        raise JaxsmolError(f"GGUF file {path} has invalid sizes: {sizes}")
    expected = _expected_shapes(cfg)
    for t in reader.tensors:
        name, shape = hf_name(t.name), tuple(int(d) for d in reversed(t.shape))
        if name not in expected:
            raise JaxsmolError(f"GGUF tensor {t.name} is not part of the model its metadata describes")
        if shape != expected[name]:
            raise JaxsmolError(f"GGUF tensor {t.name} has shape {shape}, but the metadata ({sizes}) "
                               f"implies {expected[name]}")
    return expected


def _expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The HF tensor shapes the loader will assert, from the config.json being written."""
    from jaxsmol.model.config import Config
    from jaxsmol.model.params import expected_shapes

    return expected_shapes(Config.from_hf(cfg))


def hf_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.weight"
    raise JaxsmolError(f"unsupported tensor {gguf_name!r} in GGUF file (not part of a plain Llama model)")


def dequantize(t, cfg: dict) -> np.ndarray:
    """One GGUF tensor as a float32 numpy array in HF layout (GGUF lists dims fastest-first)."""
    import gguf

    shape = tuple(int(d) for d in reversed(t.shape))
    w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    if t.name.endswith("attn_q.weight"):
        w = unpermute_qk(w, cfg["num_attention_heads"])
    elif t.name.endswith("attn_k.weight"):
        w = unpermute_qk(w, cfg["num_key_value_heads"])
    return np.ascontiguousarray(w)


def _write_safetensors(reader, cfg: dict, path: Path, wait: Wait, floats_only: bool = False) -> None:
    """Stream float32 tensors to a safetensors file one at a time (the header is known from shapes up front),
    so peak memory is one tensor rather than the whole model, advancing `wait` a tensor at a time. floats_only:
    only the tensors the file stores as F32, F16 or BF16 (a file run as it is reads the others from itself:
    gguf_weights.py)."""
    expected = _expected_shapes(cfg)
    tensors = [(t, hf_name(t.name)) for t in reader.tensors]
    found = {name for _, name in tensors}
    if found != set(expected):
        missing, extra = sorted(set(expected) - found), sorted(found - set(expected))
        raise JaxsmolError(f"GGUF tensors do not match the config: missing {missing[:5]}, unexpected {extra[:5]}")
    if floats_only:
        tensors = [(t, name) for t, name in tensors if t.tensor_type.name in FLOAT_TYPES]
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for _t, name in tensors:
        size = 4 * int(np.prod(expected[name]))
        header[name] = {"dtype": "F32", "shape": list(expected[name]), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data start to 8 bytes
    wait.total = len(tensors)
    with open(path, "wb") as f, wait:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for t, name in tensors:
            wait.advance()
            w = dequantize(t, cfg)
            if w.shape != expected[name]:
                raise JaxsmolError(f"tensor {t.name} has shape {w.shape}, expected {expected[name]}")
            f.write(w.astype("<f4", copy=False).tobytes())
        f.flush()
        os.fsync(f.fileno())  # the data is on disk before the directory is renamed into place


def pre_tokenizer(pre: str) -> dict:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if pre in ("smollm", "starcoder", "refact"):
        return {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
    if pre in ("gpt-2", "default"):
        return byte_level
    if pre == "llama-bpe":
        split = {"type": "Split", "pattern": {"Regex": _LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False}
        return {"type": "Sequence", "pretokenizers": [split, dict(byte_level, use_regex=False)]}
    raise JaxsmolError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: smollm, starcoder, refact, gpt-2, "
                       "llama-bpe)")


def _build_tokenizer(tok: dict) -> dict:
    """A `tokenizers` byte-level BPE equal to the HF tokenizer.json the GGUF was converted from."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {t: i for i, t in enumerate(tok["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in tok["merges"]]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tok["tokens"], tok["types"]) if ty == _CONTROL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, ty in zip(tok["tokens"], tok["types"]) if ty == _USER_DEFINED])
    data = json.loads(tk.to_str())
    data["pre_tokenizer"] = pre_tokenizer(tok["pre"])  # JSON form: exactly what HF ships
    return data


def _tokenizer_config(tok: dict, cfg: dict) -> dict:
    def name(i):
        return tok["tokens"][i] if i is not None and 0 <= i < len(tok["tokens"]) else None

    out = {"add_bos_token": tok["add_bos"], "add_eos_token": False, "clean_up_tokenization_spaces": False,
           "bos_token": name(tok["ids"]["bos"]), "eos_token": name(tok["ids"]["eos"]),
           "pad_token": name(tok["ids"]["padding"]), "unk_token": name(tok["ids"]["unknown"]),
           "model_max_length": cfg["max_position_embeddings"], "tokenizer_class": "GPT2Tokenizer"}
    if tok["chat_template"]:
        out["chat_template"] = tok["chat_template"]
    return out


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, as another user's
        return True
    return True


def _remove_stale_temporaries(out_dir: Path, max_age_s: float = 3600) -> None:
    """Delete what imports into `out_dir` that were killed left behind: temporary directories of a
    process that is gone (or, without a readable pid in the name, older than `max_age_s`)."""
    for p in out_dir.parent.glob(f".{glob.escape(out_dir.name)}.*.tmp"):
        rest = p.name[len(out_dir.name) + 2:]  # PID.RANDOM.tmp, or RANDOM.tmp before pids were recorded
        ours, old = re.fullmatch(r"(\d+)\.\w{8}\.tmp", rest), re.fullmatch(r"\w{8}\.tmp", rest)
        with contextlib.suppress(OSError):
            stale = (ours and not _alive(int(ours[1]))) or (old and time.time() - p.stat().st_mtime > max_age_s)
            if stale and p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)


def import_gguf(gguf_path: str | Path, out_dir: str | Path, *, progress: bool = True,
                floats_only: bool = False) -> Path:
    """Convert `gguf_path` into an HF model directory `out_dir` and return it (floats_only: its
    model.safetensors holds only the tensors stored as F32, F16 or BF16, for a file run as it is).

    All files are written into a temporary sibling directory which is then renamed into place, so
    `out_dir` either does not exist or is complete. Raises JaxsmolError for a missing, unreadable or
    non-GGUF file, a non-Llama model, or an existing non-empty `out_dir`.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = open_gguf(gguf_path)
    cfg, tok = _read_config(reader, gguf_path)
    _check_sizes(reader, cfg, gguf_path)
    tokenizer = _build_tokenizer(tok)  # fail on a bad tokenizer before the slow tensor pass
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise JaxsmolError(f"output directory {out_dir} already exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{os.getpid()}.", suffix=".tmp", dir=out_dir.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model directory should be readable like any other
        _write_json(tmp / "config.json", cfg)
        _write_json(tmp / "generation_config.json", {k: cfg[k] for k in ("bos_token_id", "eos_token_id",
                                                                          "pad_token_id")})
        _write_json(tmp / "tokenizer.json", tokenizer)
        _write_json(tmp / "tokenizer_config.json", _tokenizer_config(tok, cfg))
        what = f"importing {gguf_path.name} into {out_dir} (once)"
        _write_safetensors(reader, cfg, tmp / "model.safetensors", Wait(what, show=progress), floats_only)
        fsync_dir(tmp)
        try:
            os.rename(tmp, out_dir)  # atomic; fails if another process completed out_dir meanwhile
        except OSError as e:
            raise JaxsmolError(f"cannot move the imported model into {out_dir}: {e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out_dir.parent)
    return out_dir


def import_once(gguf_path: str | Path, out_dir: str | Path, *, progress: bool = True,
                floats_only: bool = False) -> Path:
    """`out_dir`, importing `gguf_path` there first unless an import is there already (a directory
    there is complete: import_gguf renames it into place whole). Safe when processes race: each
    imports into its own temporary directory; the loser's rename fails and it returns the winner's."""
    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    try:
        return import_gguf(gguf_path, out_dir, progress=progress, floats_only=floats_only)
    except JaxsmolError:
        if (out_dir / "model.safetensors").is_file():  # another process finished first
            return out_dir
        raise
