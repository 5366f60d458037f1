"""A/B of XLA:CPU flags on the real model, for maintainers choosing the engine's defaults (not a user benchmark).

Each flag set runs in its own process (XLA_FLAGS is read once per process), the sets alternate
round by round, and each is reported as the median over rounds of its ratio to the baseline process
of the same round (the machine is shared and loaded).

    PYTHONPATH=$PWD python tools/ab_xla_flags.py [--rounds 2] [-- "--xla_cpu_..." ...]

A child measures a cold prefill of 512 tokens (median of 2) and a decode step at position 64
(median of 3 x 8 steps), compile time excluded, and checks its greedy tokens against the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

DEFAULT_FLAGS = [
    "",  # the baseline
    "--xla_cpu_experimental_ynn_fusion_type=",  # no YNNPACK fusions: dots back on Eigen
    "--xla_cpu_experimental_xnn_fusion_type=LIBRARY_FUSION_TYPE_DOT",
    "--xla_cpu_use_xnnpack=true",
    "--xla_cpu_enable_fast_math=true",
    "--xla_cpu_prefer_vector_width=512",
]

CHILD = r"""
import json, statistics, time, numpy as np, jax.numpy as jnp
from jaxsmol.runtime.engine import Engine
eng = Engine.load(progress=False)
ids = list(range(1000, 1512))
def prefill():
    kv = eng.new_cache(eng.slots_needed(0, 512, 1)); t0 = time.perf_counter()
    logits, kv = eng.prefill(ids, kv); np.asarray(logits); eng.recycle(kv)
    return time.perf_counter() - t0, int(np.argmax(np.asarray(logits[0])))
def decode(steps=8):
    kv = eng.new_cache(eng.slots_needed(0, 64, steps + 1)).replace(pos=jnp.int32(64)); tok, out = 100, []
    t0 = time.perf_counter()
    for _ in range(steps):
        logits, kv = eng.decode(tok, kv); tok = int(np.argmax(np.asarray(logits[0]))); out.append(tok)
    eng.recycle(kv)
    return (time.perf_counter() - t0) / steps, out
prefill(); decode(2)  # compile
p = [prefill() for _ in range(2)]; d = [decode() for _ in range(3)]
print(json.dumps({"prefill_s": statistics.median(x[0] for x in p), "decode_s": statistics.median(x[0] for x in d),
                  "tokens": [p[0][1]] + d[0][1]}))
"""


def child(flags: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": flags, "JAXSMOL_COMPILE_CACHE": "off"}
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=1200)
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("flags", nargs="*", help="flag sets to try, after `--` (the baseline is added first)")
    args = ap.parse_args()
    sets = [""] + [f for f in (args.flags or DEFAULT_FLAGS) if f]
    ratios = {f: {"prefill": [], "decode": []} for f in sets}
    same = {f: True for f in sets}
    for rnd in range(args.rounds):
        base = None
        for f in sets:
            res = child(f)
            if "error" in res:
                print(f"round {rnd}: {f or 'baseline'}: {res['error']}", flush=True)
                continue
            if f == "":
                base = res
            if base is None:
                continue
            ratios[f]["prefill"].append(res["prefill_s"] / base["prefill_s"])
            ratios[f]["decode"].append(res["decode_s"] / base["decode_s"])
            same[f] &= res["tokens"] == base["tokens"]
            print(f"round {rnd}: {f or 'baseline'}: prefill 512 {512 / res['prefill_s']:.0f} tok/s, "
                  f"decode@64 {1 / res['decode_s']:.1f} tok/s", flush=True)
    print("\ntime ratio to the baseline (median over rounds; < 1 is faster), and whether greedy tokens match:")
    for f in sets[1:]:
        r = ratios[f]
        if r["prefill"]:
            print(f"  {f}: prefill {statistics.median(r['prefill']):.2f}, decode {statistics.median(r['decode']):.2f}, "
                  f"same tokens: {same[f]}")


if __name__ == "__main__":
    main()
