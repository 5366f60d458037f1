"""Where the forward's time goes: a per-op table from a `jax.profiler` trace of the real model.

    PYTHONPATH=$PWD python tools/profile_forward.py [--model DIR] [--dtype float32] [--runs 3]

Runs five programs (a cold prefill of 512 tokens, the second 512-token chunk of a 1024-token prompt,
one decode step at position 64, the warm path's 16-row chunk at 1008, a decode step at 2000), each
compiled and warmed first, then traced `--runs` times. Every XLA:CPU thunk in the trace is an HLO
instruction of the compiled program; its *self* time (its span minus the spans nested in it on the
same thread) is attributed to a category through the source line the instruction came from (the
compiled HLO's StackFrames table): projections, attention (its two einsums apart from its softmax),
norms, RoPE, the KV write, the LM head, and loop
control. Thunks that run concurrently on two threads are both counted, so the shares are of thread
time; the wall time per call is measured apart (median of the traced runs).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

# (function, source-text fragment) -> category; the first match wins, the fragment is matched
# against the source line the instruction came from (model.py, or cpu_kernels.py for the kernels).
CATEGORIES = [
    ("matmul", "", "matmuls (C++ kernel; the LM head's too)"),
    ("attention", "call(q, k_all", "attention (C++ kernel)"),
    ("block", "", "attention: softmax, mask, running max"),
    ("_attention_tile", "", "attention: setup and output"),
    ("attention", "", "attention: query tiling"),
    ("<lambda>", "", "attention: query tiling"),
    ("_write", "", "KV cache write (dynamic-update-slice)"),
    ("rms_norm", "", "RMS norms"),
    ("_mean_square_in_order", "", "RMS norms"),
    ("_fold", "", "RMS norms"),
    ("apply_rope", "", "RoPE"),
    ("rope_tables", "", "RoPE"),
    ("decoder_layer", "silu", "MLP silu(gate) * up"),
    ("decoder_layer", "apply_rope", "RoPE"),
    ("decoder_layer", "x = x +", "residual adds"),
    ("forward", "unembed", "LM head"),
    ("forward", "embed", "embedding lookup"),
]


def parse_hlo(text: str, source: dict[str, list[str]], vocab: int) -> dict[str, str]:
    """HLO instruction name -> category, through each instruction's (or its fused body's) stack frame."""
    files = dict(re.findall(r'^(\d+) "(.*)"$', text.split("FunctionNames", 1)[0], re.M))
    funcs = dict(re.findall(r'^(\d+) "(.*)"$', text.split("FunctionNames", 1)[1].split("FileLocations")[0], re.M))
    locs = {i: (f, fn, int(line)) for i, f, fn, line in
            re.findall(r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", text, re.M)}
    frames = dict(re.findall(r"^(\d+) \{file_location_id=(\d+)", text, re.M))
    first_frame: dict[str, str] = {}  # computation -> first stack frame used in it
    dots: dict[str, str] = {}  # computation -> the kind of the dot in it, if any
    comp = None
    calls, frame_of, own_dot = {}, {}, {}
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if m:
            comp = m.group(1)
            continue
        m = re.match(r"^\s*(?:ROOT )?%(\S+) = (\S+)", line)
        if not m:
            continue
        sf = re.search(r"stack_frame_id=(\d+)", line)
        if sf:
            first_frame.setdefault(comp, sf.group(1))
            frame_of[m.group(1)] = sf.group(1)
        if " dot(" in line:  # dots often carry no source line: tell them apart by shape
            kind = ("attention: QK^T and PV einsums" if "lhs_batch_dims" in line else
                    "LM head" if re.search(rf"\b{vocab}\]", m.group(2)) else "projections q k v o gate up down")
            dots[comp] = own_dot[m.group(1)] = kind
        c = re.search(r"calls=%([\w.\-]+)", line)
        if c:
            calls[m.group(1)] = c.group(1)

    def category(frame: str | None) -> str:
        if frame is None or frame not in frames:
            return "copies and loop control (no source line)"
        f, fn, line = locs[frames[frame]]
        name, path = funcs[fn].rsplit(".", 1)[-1] if "<locals>" in funcs[fn] else funcs[fn], files[f]
        src = source.setdefault(path, Path(path).read_text().splitlines() if Path(path).exists() else [])
        code = src[line - 1] if 0 < line <= len(src) else ""
        for fname, fragment, cat in CATEGORIES:
            if name == fname and fragment in code:
                return cat
        return f"other ({funcs[fn]}:{line})"

    out = {}
    for inst in set(frame_of) | set(calls) | set(own_dot):
        dot = own_dot.get(inst) or dots.get(calls.get(inst))
        out[inst] = dot or category(frame_of.get(inst) or first_frame.get(calls.get(inst)))
    return out


def self_times(trace_file: Path) -> dict[str, float]:
    """Thunk name -> total self time in microseconds, over every thread of the trace."""
    events = [e for e in json.load(gzip.open(trace_file))["traceEvents"] if e.get("ph") == "X"]
    out: dict[str, float] = collections.defaultdict(float)
    by_tid = collections.defaultdict(list)
    for e in events:
        by_tid[e["tid"]].append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[list] = []  # [end, name, self]
        for e in evs:
            start, dur = e["ts"], e.get("dur", 0)
            while stack and stack[-1][0] <= start:
                end, name, own = stack.pop()
                out[name] += own
            if stack:
                stack[-1][2] -= dur
            stack.append([start + dur, e["name"], dur])
        for _end, name, own in stack:
            out[name] += own
    return out


def profile(name, fn, compiled_text, runs, source, vocab) -> dict:
    """Trace fn() `runs` times; returns {"wall_ms", "rows": [(category, ms per call)]}."""
    import jax

    cats = parse_hlo(compiled_text, source, vocab)
    fn()  # warm
    walls = []
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - t0)
        jax.profiler.stop_trace()
        trace = next(Path(d).rglob("perfetto_trace.json.gz"))
        times = self_times(trace)
    per_cat = collections.defaultdict(float)
    for thunk, us in times.items():
        if thunk in cats:
            per_cat[cats[thunk]] += us / 1000 / runs
    rows = sorted(per_cat.items(), key=lambda r: -r[1])
    return {"name": name, "wall_ms": statistics.median(walls) * 1000, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    import jax.numpy as jnp
    import numpy as np

    from jaxsmol.runtime import programs
    from jaxsmol.runtime.engine import Engine

    # compiled here, not loaded from the disk cache: a cached program's HLO keeps the source lines of
    # the code that first compiled it (its key ignores them), which would attribute thunks wrongly
    os.environ["JAXSMOL_COMPILE_CACHE"] = "off"
    eng = Engine.load(args.model, dtype=args.dtype, progress=False)
    source: dict = {}
    results = []
    for name, T, pos, slots in (("prefill 512", 512, 0, 513),
                                ("prefill 512 at 512 (a 1024-token prompt's 2nd chunk)", 512, 512, 1025),
                                ("decode at 64", 1, 64, 65),
                                ("16 rows at 1008 (the warm path's chunk)", 16, 1008, 1025),
                                ("decode at 2000", 1, 2000, 2001)):
        kv0 = eng.new_cache(slots).replace(pos=jnp.int32(pos))
        tokens = jnp.asarray(np.arange(100, 100 + T, dtype=np.int32)[None])
        text = programs.forward.lower(eng.params, tokens, jnp.int32(T), kv0, eng.cfg).compile().as_text()
        state = {"kv": kv0}

        def run(tokens=tokens, T=T, state=state, pos=pos):
            logits, kv = programs.forward(eng.params, tokens, jnp.int32(T), state["kv"], eng.cfg)
            np.asarray(logits)
            state["kv"] = kv.replace(pos=jnp.int32(pos))
        results.append(profile(name, run, text, args.runs, source, eng.cfg.vocab_size))
    for r in results:
        total = sum(ms for _, ms in r["rows"])
        print(f"\n{r['name']}: wall {r['wall_ms']:.1f} ms per call, thunk self time {total:.1f} ms")
        for cat, ms in r["rows"]:
            print(f"  {ms:8.2f} ms  {100 * ms / total:5.1f}%  {cat}")


if __name__ == "__main__":
    main()
