"""What the benchmark runs: its sections, the full and quick plans, and the random prompts."""

from __future__ import annotations

SECTIONS = ("compilations", "prefill", "decode", "ttft", "snapshot", "cli")
HEADLINE = (1008, 16)  # the course exercise's question: a 1008-token shared prefix, then 16 new tokens

FULL = dict(
    prefill=(128, 512, 1024, 2048), prefill_repeats=3,
    decode_positions=(64, 2000), decode_steps=32, decode_repeats=3,
    ttft_prefixes=(128, 512, 1024, 2048), ttft_suffixes=(1, 16, 128), ttft_repeats=3, headline_repeats=5,
    ttft_exact=(True, False),
    headline_modes=(("radix", True), ("radix", False), ("minimal", True), ("off", True)),
    trunk=512, branch=32, branches=(1, 2, 4, 8),
    workload_requests=100, workload_docs=4, workload_random=0.25, workload_max_prompt=1500, workload_max_tokens=8,
    cli_prompt=1024, cli_repeats=2,
    hf_prefill=(512, 1024, 2048), hf_repeats=3,
)
QUICK = dict(
    FULL,
    prefill=(128, 512), prefill_repeats=2,
    decode_steps=8, decode_repeats=1,
    ttft_prefixes=(128,), ttft_repeats=1, headline_repeats=1,
    headline_modes=(("radix", True), ("radix", False), ("minimal", True)),
    workload_requests=12, workload_docs=1, workload_random=0.0,
    cli_prompt=128, cli_repeats=1,
    hf_prefill=(512, 1024), hf_repeats=1,
)


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
