#!/usr/bin/env python
"""Make `tests/fixtures/hf_reference.json`: reference outputs of Hugging Face transformers.

This is a fixture-making tool, not part of jaxsmol: it needs torch and transformers, which the
project never depends on. Run it in a separate venv (see below); the tests that read the fixture
(`tests/test_hf_parity.py`) use only the project's own engine.

    python3 -m venv .refenv
    .refenv/bin/pip install torch==2.13.0 transformers tokenizers safetensors numpy gguf sentencepiece accelerate
    .venv/bin/python -c "from jaxsmol.checkpoint.default_model import default_model_dir; print(default_model_dir())"
    .refenv/bin/python tools/make_hf_reference.py --model ~/.cache/jaxsmol/models/SmolLM2-135M-Instruct \
        --out tests/fixtures/hf_reference.json

With `--check-gguf FILE.gguf` it instead (or also, with --out) cross-checks the imported weights:
transformers loads the GGUF by itself (it dequantizes and un-permutes Q/K on its own) and every
tensor is compared with the imported `model.safetensors` (max abs diff per tensor).

Everything runs on CPU in float32. For each prompt (token ids, encoded with the HF fast tokenizer
built from the model dir's tokenizer.json) it records:

* `greedy_ids`: 12 tokens of `model.generate(do_sample=False)`, with end-of-sequence stopping
  disabled (so the count is always 12; `eos_token_id` is recorded, and a consumer whose generation
  stops at EOS compares the prefix up to and including the first EOS).
* `gen_top`: for each generation step (the prompt's last position, then each generated token but
  the last), the top-5 token ids and their log-probs (log_softmax of the float32 logits of the
  KV-cached decode step): exactly what a `logprobs=5` generation reports per generated token.
* `full_top`: the top-5 ids and log-probs at EVERY position of one uncached forward over
  prompt + greedy_ids (teacher-forced), i.e. what `logits_all(prompt_ids + greedy_ids)` gives.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

N_NEW = 12
TOP_K = 5
DECIMALS = 6

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHAT = (
    f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
PARAGRAPH = (
    "The printing press changed Europe in the fifteenth century. Johannes Gutenberg combined movable "
    "metal type with oil-based ink and a wooden screw press, and his workshop in Mainz printed the famous "
    "Bible around 1455. Within fifty years, printing shops had spread to more than two hundred cities, and"
)

# (name, text or None, explicit ids or None)
PROMPTS = [
    ("plain", "The capital of France is", None),
    ("chat", CHAT, None),
    ("paragraph", PARAGRAPH, None),
    ("ids", None, [1, 0, 1, 2, 3]),
]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def top_k(logits: torch.Tensor, k: int = TOP_K) -> dict:
    """logits [V] float32 -> {"ids": [k], "logprobs": [k]} of log_softmax, best first."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = torch.topk(lp, k)
    return {"ids": [int(i) for i in ids], "logprobs": [round(float(v), DECIMALS) for v in vals]}


def load_model(model_dir: Path):
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, output_loading_info=True
    )
    missing = [k for k in info.get("missing_keys", [])
               if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or info.get("unexpected_keys") or info.get("mismatched_keys"):
        sys.exit(f"weights do not load cleanly: {info}")
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.eval()
    return model


def _case(model, tok, gen_cfg, name: str, text, ids) -> dict:
    """One prompt: greedy generation (its per-step top-k) and one uncached forward over prompt + answer
    (its top-k at every position), with their consistency checked."""
    if ids is None:
        ids = tok(text, add_special_tokens=False)["input_ids"]
    ids = [int(i) for i in ids]
    inp = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        g = model.generate(inp, attention_mask=torch.ones_like(inp), generation_config=gen_cfg)
    new = [int(t) for t in g.sequences[0, len(ids):]]
    assert len(new) == N_NEW, (name, new)
    gen_top = [top_k(step[0]) for step in g.logits]
    # greedy consistency: each generated token is the argmax of its step's logits
    for t, step in zip(new, g.logits):
        assert int(torch.argmax(step[0])) == t, (name, t)

    full = torch.tensor([ids + new], dtype=torch.long)
    with torch.no_grad():
        logits = model(full, use_cache=False).logits[0].float()  # [T, V]
    full_top = [top_k(row) for row in logits]
    # the cached decode and the uncached forward agree on the steps they share
    for i, step in enumerate(g.logits):
        d = float((step[0].float() - logits[len(ids) - 1 + i]).abs().max())
        assert d < 1e-3, (name, i, d)
    print(f"{name}: {len(ids)} prompt tokens -> {new} {tok.decode(new)!r}", file=sys.stderr)
    return {
        "name": name,
        "text": text,
        "prompt_ids": ids,
        "greedy_ids": new,
        "greedy_text": tok.decode(new),
        # smallest top-1 minus top-2 log-prob gap over the greedy steps (a near-tie is fragile)
        "min_greedy_margin": round(min(t["logprobs"][0] - t["logprobs"][1] for t in gen_top), DECIMALS),
        "gen_top": gen_top,
        "full_top": full_top,
    }


def _fixture(model_dir: Path, cfg, tok, cases: list[dict]) -> dict:
    """The fixture's JSON: versions, the model's identity (hashes), stop ids, the cases."""
    import transformers

    eos = cfg.eos_token_id
    return {
        "about": "Hugging Face transformers reference for jaxsmol (tools/make_hf_reference.py); "
                 "float32 CPU; logprobs are log_softmax of float32 logits, rounded to 6 decimals",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
        "model": {
            "dir_name": model_dir.name,
            "model_safetensors_sha256": sha256(model_dir / "model.safetensors"),
            "tokenizer_json_sha256": sha256(model_dir / "tokenizer.json"),
            "vocab_size": cfg.vocab_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "tie_word_embeddings": bool(cfg.tie_word_embeddings),
        },
        "eos_token_id": eos,
        # ids at which a consumer's generation may legitimately stop early
        "stop_ids": sorted({int(i) for i in ([eos] if isinstance(eos, int) else list(eos or []))}
                           | {int(tok.convert_tokens_to_ids(t)) for t in ("<|endoftext|>", "<|im_end|>")
                              if tok.convert_tokens_to_ids(t) is not None}),
        "n_new": N_NEW,
        "top_k": TOP_K,
        "cases": cases,
    }


def make_reference(model_dir: Path, out: Path) -> None:
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    tok = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    model = load_model(model_dir)
    cfg = model.config
    gen_cfg = GenerationConfig(
        max_new_tokens=N_NEW, min_new_tokens=0, do_sample=False, num_beams=1,
        eos_token_id=None, pad_token_id=cfg.pad_token_id if cfg.pad_token_id is not None else 0,
        bos_token_id=cfg.bos_token_id,
        output_logits=True, return_dict_in_generate=True,
    )

    # EOS stopping off, so that every case has N_NEW tokens. generate() fills unset fields of the
    # passed config from model.generation_config (the model dir's generation_config.json, which may
    # name an eos or sampling defaults), so replace that one too.
    model.generation_config = gen_cfg

    cases = [_case(model, tok, gen_cfg, name, text, ids) for name, text, ids in PROMPTS]
    data = _fixture(model_dir, cfg, tok, cases)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    # one case per line keeps diffs readable without blowing up the size
    text = text.replace(',{"name":', ',\n{"name":')
    out.write_text(text + "\n", encoding="utf-8")
    print(f"wrote {out} ({out.stat().st_size} bytes)", file=sys.stderr)


def group_of(name: str) -> str:
    parts = name.split(".")
    return ".".join(p for p in parts if not p.isdigit()).removeprefix("model.")


def check_gguf(model_dir: Path, gguf_path: Path, tol: float) -> int:
    """Compare every tensor transformers makes from the GGUF with the imported model.safetensors."""
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    ref = {k: v.detach().float().numpy() for k, v in ref_model.state_dict().items()}
    got = load_file(str(model_dir / "model.safetensors"))
    tied = bool(ref_model.config.tie_word_embeddings)
    if tied and "lm_head.weight" not in got:
        ref.pop("lm_head.weight", None)
    rows, bad = [], []
    for k in sorted(set(ref) | set(got)):
        if k not in got or k not in ref:
            bad.append(f"{k}: only in {'gguf (transformers)' if k in ref else 'imported safetensors'}")
            continue
        a, b = ref[k], got[k]
        if a.shape != b.shape:
            bad.append(f"{k}: shape {b.shape} (imported) != {a.shape} (transformers)")
            continue
        if b.dtype != np.float32:
            bad.append(f"{k}: imported dtype {b.dtype}, not float32")
        d = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
        rows.append((k, d))
        if not d <= tol:
            bad.append(f"{k}: max abs diff {d:.3g}")
    groups: dict[str, float] = {}
    counts: dict[str, int] = {}
    for k, d in rows:
        g = group_of(k)
        groups[g] = max(groups.get(g, 0.0), d)
        counts[g] = counts.get(g, 0) + 1
    print(f"imported {model_dir / 'model.safetensors'} vs transformers from {gguf_path.name}:")
    for g in sorted(groups):
        print(f"  {g:40s} {counts[g]:3d} tensors  max abs diff {groups[g]:.3g}")
    print(f"  {len(rows)} tensors compared, tied embeddings: {tied}")
    if bad:
        print("MISMATCH:")
        for b in bad:
            print("  " + b)
        return 1
    print("OK: all tensors match")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path,
                    help="HF-layout model dir (config.json, model.safetensors, tokenizer.json)")
    ap.add_argument("--out", type=Path, help="fixture to write, e.g. tests/fixtures/hf_reference.json")
    ap.add_argument("--check-gguf", type=Path, help="GGUF file to cross-check the imported weights against")
    ap.add_argument("--tol", type=float, default=1e-6, help="max abs diff allowed per tensor in --check-gguf")
    args = ap.parse_args(argv)
    model_dir = args.model.expanduser()
    rc = 0
    if args.check_gguf:
        rc = check_gguf(model_dir, args.check_gguf.expanduser(), args.tol)
    if args.out:
        make_reference(model_dir, args.out)
    elif not args.check_gguf:
        ap.error("give --out and/or --check-gguf")
    return rc


if __name__ == "__main__":
    sys.exit(main())
