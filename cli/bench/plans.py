"""What the benchmark runs: its sections, the full and quick plans, and the random prompts."""

from __future__ import annotations

SECTIONS = ("compilations", "prefill", "decode", "ttft", "snapshot", "cli")  # the default run, in this order
# run only when named in --only (each takes minutes at its full sizes, or starts daemons), after the above
EXTRA_SECTIONS = ("forks", "prompt-cache", "ttft-peer", "serve", "first-burst", "ready", "cluster", "admission",
                  "speculate")
HEADLINE = (1008, 16)  # the course exercise's question: a 1008-token shared prefix, then 16 new tokens

FULL = dict(
    prefill=(128, 512, 1024, 2048), prefill_repeats=3,
    decode_positions=(64, 2000), decode_steps=32, decode_repeats=3,
    ttft_prefixes=(128, 512, 1024, 2048), ttft_suffixes=(1, 16, 128), ttft_repeats=3, headline_repeats=5,
    ttft_exact=(True, False),
    headline_modes=(("radix", True), ("radix", False), ("single", True), ("off", True)),
    trunk=512, branch=32, branches=(1, 2, 4, 8),
    workload_requests=100, workload_docs=4, workload_random=0.25, workload_max_prompt=1500, workload_max_tokens=8,
    cli_prompt=1024, cli_repeats=2,
    hf_prefill=(512, 1024, 2048), hf_repeats=3,
    forks_prompt=500, forks_n=8, forks_tokens=64, forks_rounds=3,
    pc_prefix=1008, pc_suffix=16, pc_repeats=5,
    peer_prefix=1008, peer_suffix=16, peer_rounds=5,
    serve_clients=(1, 2, 4, 8, 16), serve_tokens=64, serve_long=True, serve_max_batch=16, serve_prefill_chunk=48,
    serve_batch_invariant=False,
    burst_idle=25.0, burst_clients=8, burst_tokens=32, burst_rounds=2, burst_max_batch=16,
    ready_tokens=64, ready_settled=5, ready_max_batch=16,
    cluster_replicas=2, cluster_tenants=6, cluster_per_tenant=12, cluster_prefix=800, cluster_suffix=30,
    cluster_turns=4, cluster_clients=4, cluster_tokens=8, cluster_room=2, cluster_max_batch=8,
    cluster_variants=("completions", "chat"), cluster_first_together=False, cluster_batch_invariant=False,
    cluster_shared=("completions", "chat"),  # the variants run again with --shared-cache (none: not at all)
    cluster_shared_write=("through", "back"),  # --shared-cache-write of those runs, each its own directory
    admission_workloads=("bursts", "churn"), admission_blocks=2, admission_hot=0.75, admission_churn_blocks=6,
    admission_block_tokens=400, admission_question=20, admission_clients=12, admission_requests=4,
    admission_max_batch=4, admission_cache_blocks=2.5, admission_rounds=1, admission_tokens=16,
    spec_tokens=128, spec_rounds=3,
)
QUICK = dict(
    FULL,
    prefill=(128, 512), prefill_repeats=2,
    decode_steps=8, decode_repeats=1,
    ttft_prefixes=(128,), ttft_repeats=1, headline_repeats=1,
    headline_modes=(("radix", True), ("radix", False), ("single", True)),
    workload_requests=12, workload_docs=1, workload_random=0.0,
    cli_prompt=128, cli_repeats=1,
    hf_prefill=(512, 1024), hf_repeats=1,
    forks_prompt=128, forks_n=4, forks_tokens=16, forks_rounds=1,
    pc_repeats=2, peer_rounds=2,
    serve_clients=(1, 4), serve_tokens=16, serve_max_batch=4,
    burst_idle=5.0, burst_clients=4, burst_tokens=8, burst_rounds=1,
    ready_tokens=16, ready_settled=2,
    cluster_tenants=4, cluster_per_tenant=8, cluster_prefix=400, cluster_tokens=4, cluster_shared=(),
    admission_churn_blocks=3, admission_block_tokens=64, admission_question=8, admission_clients=4,
    admission_requests=2, admission_max_batch=2, admission_cache_blocks=1.5, admission_tokens=4,
    spec_tokens=24, spec_rounds=1,
)

# the flags of the extra sections (cli/main.py _add_bench) -> the plan entries each one sets
FLAG_KEYS = {
    "tokens": ("serve_tokens", "forks_tokens", "burst_tokens", "ready_tokens", "admission_tokens", "spec_tokens"),
    "rounds": ("forks_rounds", "pc_repeats", "peer_rounds", "burst_rounds", "admission_rounds", "spec_rounds"),
    "prefix": ("pc_prefix", "peer_prefix"),
    "suffix": ("pc_suffix", "peer_suffix"),
    "prompt_tokens": ("forks_prompt",),
    "samples": ("forks_n",),
    "max_batch": ("serve_max_batch", "burst_max_batch", "ready_max_batch", "admission_max_batch"),
    "prefill_chunk": ("serve_prefill_chunk",),
    "idle": ("burst_idle",),
    "replicas": ("cluster_replicas",),
}


def add_section_flags(parser) -> None:
    """The flags of FLAG_KEYS and with_flags, and the report's, on `jaxsmol bench`'s parser."""
    e = parser.add_argument_group("sizes of the sections named in --only (default: the full or --quick plan's)")
    e.add_argument("--clients", type=int, nargs="+", metavar="N", help="serve: concurrent streaming clients, a row "
                   "each (full plan 1 2 4 8 16); first-burst, admission: the largest")
    e.add_argument("--tokens", type=int, metavar="N", help="tokens per answer (serve, forks, first-burst, ready, "
                   "admission, speculate)")
    e.add_argument("--rounds", type=int, metavar="N", help="rounds, medians over them (forks, prompt-cache, "
                   "ttft-peer, first-burst, admission, speculate)")
    e.add_argument("--prefix", type=int, metavar="N", help="stored prefix tokens (ttft-peer, prompt-cache; 1008)")
    e.add_argument("--suffix", type=int, metavar="N", help="new tokens after it (ttft-peer, prompt-cache; 16)")
    e.add_argument("--prompt-tokens", type=int, metavar="N", help="forks: the question's tokens (500)")
    e.add_argument("--samples", type=int, metavar="N", help="forks: samples of the question (8)")
    e.add_argument("--max-batch", type=int, metavar="N", help="serve, first-burst, ready: the daemon's --max-batch "
                   "(16); admission: (4)")
    e.add_argument("--prefill-chunk", type=int, metavar="ROWS", help="serve: the daemon's --prefill-chunk (48)")
    e.add_argument("--batch-invariant", action="store_true", help="serve: the daemon's --batch-invariant")
    e.add_argument("--no-long", action="store_true", help="serve: skip the rows with long prompts arriving")
    e.add_argument("--idle", type=float, metavar="S", help="first-burst: seconds between /health and the burst (25)")
    e.add_argument("--replicas", type=int, metavar="N", help="cluster: daemons behind the router (2); it takes the "
                   "largest of --clients (4) and --max-batch (8) too")
    r = parser.add_argument_group("the markdown performance table (docs/performance.md, cli/bench/performance.py)")
    r.add_argument("--report", nargs="*", metavar="RESULTS", help="also print this run's measurements as the markdown "
                   "table; with files (earlier runs' --json results), print theirs and run nothing")
    r.add_argument("--peer-name", metavar="NAME", help="the --peer-url server's name in the tables (e.g. llama.cpp)")


def with_flags(plan: dict, args) -> dict:
    """The plan with the values the command line gave (a flag left out keeps the plan's)."""
    out = dict(plan)
    for flag, keys in FLAG_KEYS.items():
        value = getattr(args, flag, None)
        if value is not None:
            out.update(dict.fromkeys(keys, value))
    if getattr(args, "clients", None):
        out["serve_clients"], out["burst_clients"] = tuple(args.clients), max(args.clients)
        out["admission_clients"] = max(args.clients)
    if getattr(args, "no_long", False):
        out["serve_long"] = False
    if getattr(args, "batch_invariant", False):
        out["serve_batch_invariant"] = True
    if getattr(args, "clients", None):
        out["cluster_clients"] = max(args.clients)
    if getattr(args, "max_batch", None):
        out["cluster_max_batch"] = args.max_batch
    return out


def rand_ids(rng, n: int, vocab: int) -> list[int]:
    """n ordinary token ids (cost does not depend on which ones)."""
    return [int(x) for x in rng.integers(100, vocab, n)]


def two_suffixes(rng, n: int, vocab: int) -> tuple[list[int], list[int]]:
    """Two suffixes of n tokens whose first tokens differ, so a prompt ending in one shares with a
    prompt ending in the other exactly the prefix before them."""
    a = rand_ids(rng, n, vocab)
    b = rand_ids(rng, n, vocab)
    while b[0] == a[0]:
        b[0] = int(rng.integers(100, vocab))
    return a, b
