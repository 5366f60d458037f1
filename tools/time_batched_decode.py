"""Time a batched decode step at widths 1/2/4/8/16: per-row positions against one shared position.

The per-row-position path (kv.pos [W], as the scheduler runs it) against a same-position batch of
the same width (kv.pos scalar), in one process.

    PYTHONPATH=$PWD python tools/time_batched_decode.py [--model DIR] [--position 64] [--rounds 5] [--matmul int8]

Variants alternate round by round and each figure is a median over rounds (the machine is shared).
`decode_step` is the scheduler's program (forward + per-row sampling); `forward pos[W]` and
`forward pos[]` are the bare forward with a position vector and with one scalar position.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _sampling(W: int, V: int) -> dict:
    """Greedy per-row sampling arrays for W rows, every token allowed."""
    import jax.numpy as jnp

    return {"temperature": jnp.zeros(W), "top_k": jnp.zeros(W, jnp.int32), "top_p": jnp.ones(W),
            "seed_lo": jnp.zeros(W, jnp.uint32), "seed_hi": jnp.zeros(W, jnp.uint32),
            "step": jnp.zeros(W, jnp.int32), "allowed": jnp.full((W, -(-V // 32)), -1, jnp.int32)}


def _runners(eng, W: int, cap: int, pos: int) -> dict:
    """The three variants at width W, each one decode step on its own cache: name -> a call."""
    import jax.numpy as jnp
    import numpy as np

    from jaxsmol.runtime import programs
    from jaxsmol.model.kv import KVCache

    cfg = eng.cfg
    tok = jnp.full((W,), 100, jnp.int32)
    state = {"step": KVCache.zeros(cfg, cap, batch=W), "vec": KVCache.zeros(cfg, cap, batch=W),
             "scalar": KVCache.zeros(cfg, cap, batch=W)}
    sp, active = _sampling(W, cfg.vocab_size), jnp.ones(W, bool)

    def step():
        out, kv = programs.decode_step(eng.params, tok, state["step"].replace(pos=jnp.full(W, pos, jnp.int32)),
                                       active, sp, cfg)
        np.asarray(out["tokens"])
        state["step"] = kv

    def vec():
        logits, kv = programs.forward(eng.params, tok[:, None], jnp.int32(1),
                                      state["vec"].replace(pos=jnp.full(W, pos, jnp.int32)), cfg)
        np.asarray(logits)
        state["vec"] = kv

    def scalar():
        logits, kv = programs.forward(eng.params, tok[:, None], jnp.int32(1),
                                      state["scalar"].replace(pos=jnp.int32(pos)), cfg)
        np.asarray(logits)
        state["scalar"] = kv
    return {"decode_step": step, "forward pos[W]": vec, "forward pos[]": scalar}


def _time_width(fns: dict, rounds: int, steps: int) -> tuple[dict, list[float]]:
    """(median ms per step of each variant, the per-round pos[W] / pos[] ratios), rounds alternating."""
    for f in fns.values():
        f()  # compile
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                f()
            times[n].append((time.perf_counter() - t0) / steps)
    row = {n: statistics.median(t) * 1000 for n, t in times.items()}
    ratio = [a / b for a, b in zip(times["forward pos[W]"], times["forward pos[]"])]
    row["ratio"] = statistics.median(ratio)
    return row, ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--position", type=int, default=64)
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--matmul", default="auto", help="Engine.load's matmul class (auto, exact, int8)")
    args = ap.parse_args()

    from jaxsmol.runtime.chunks import capacity_for
    from jaxsmol.runtime.engine import Engine

    eng = Engine.load(args.model, matmul=args.matmul, progress=False)
    cap, pos = capacity_for(args.position + args.steps + 1), args.position
    table = {}
    for W in args.widths:
        table[W], ratio = _time_width(_runners(eng, W, cap, pos), args.rounds, args.steps)
        print(f"W={W:2d}: " + ", ".join(f"{n} {ms:.1f} ms" for n, ms in table[W].items() if n != "ratio")
              + f"; pos[W]/pos[] {table[W]['ratio']:.2f} (per round {[round(r, 2) for r in ratio]})", flush=True)
    one = table[args.widths[0]]["decode_step"]
    for W in args.widths:
        print(f"W={W:2d}: decode_step {table[W]['decode_step'] / one:.2f}x the width-{args.widths[0]} step, "
              f"{W * one / table[W]['decode_step']:.2f}x its tokens/s")


if __name__ == "__main__":
    main()
