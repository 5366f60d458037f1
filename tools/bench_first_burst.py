"""A fresh daemon's first burst of clients, with and without compiling the batched programs ahead.

    python tools/bench_first_burst.py [--idle 25] [--clients 8] [--tokens 32] [--rounds 2]

For each round, starts `jaxsmol serve` with the default (`--no-compile-ahead` off) and then with
`--no-compile-ahead`; once /health answers, waits `--idle` seconds (a daemon is usually up a while
before its first clients), then sends a burst of concurrent streaming clients and a second burst of
other prompts (everything compiled by then: the reference). Prints wall time, time to first token
and inter-token latency of both bursts. Uses tools/bench_serve.py's client.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import httpx

from bench_serve import ROOT, free_port, run_clients  # tools/, beside this file


def start(flags: list[str]) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "cli.main", "serve", "--port", str(port), "--ctx", "2048", *flags]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the daemon exited with {proc.returncode}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--idle", type=float, default=25.0, help="seconds between /health and the first burst")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    for _ in range(args.rounds):
        for flags in ([], ["--no-compile-ahead"]):
            proc, url, up_s = start(flags)
            try:
                time.sleep(args.idle)
                print(f"{' '.join(flags) or 'compile ahead':18} healthy after {up_s:.1f} s", flush=True)
                for seed, label in ((1, "first burst"), (2, "second burst")):
                    t0 = time.perf_counter()
                    r = asyncio.run(run_clients(url, args.clients, args.tokens, False, seed=seed))
                    print(f"  {label:12} wall {time.perf_counter() - t0:5.1f} s  TTFT p50 / p99 "
                          f"{r['ttft_p50_ms']:6.0f} / {r['ttft_p99_ms']:6.0f} ms  ITL p50 / p99 "
                          f"{r['itl_p50_ms']:4.0f} / {r['itl_p99_ms']:5.0f} ms", flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=120)


if __name__ == "__main__":
    main()
