"""`jaxsmol bench`, the one entry point for every benchmark a user runs: prefill and decode speed,
prefix-cache time to first token, snapshot memory, compilations and a fresh process's first token;
optionally side by side with Hugging Face; and, when named in --only, forks, the prompt cache on
disk, time to first token against a peer server and serving throughput at N clients.

Every timed section runs after the programs it needs are compiled (compile time is excluded, except
in the fresh-process section, whose point is compile time), and reports the median of its repeats.
Sections:

  compilations  programs a mixed workload through the radix cache compiles after compile-ahead (0: closed).
                Runs first, so that the count starts from a process that has compiled nothing.
  prefill       tokens/s of a cold prefill (no cache) of n tokens
  decode        tokens/s of decode steps at a short and a long position
  ttft          time to first token, cold (first request on an empty cache) vs warm (a prompt sharing a
                prefix with it) vs an exact full hit (the same prompt again), and the headline row
                (1008-token shared prefix + 16 new tokens) for each cache mode
  snapshot      bytes held by the radix store for n branches sharing a trunk, vs n full copies
  cli           a fresh `jaxsmol generate` process, without and with the persistent compilation cache
  hf            (--compare hf) the same prefill, decode and prefix reuse with Hugging Face transformers

Only when named in --only (each takes minutes at its full sizes, or starts daemons):

  forks         n samples of one question: batched forks vs n sequential runs vs n cached runs
  prompt-cache  time to first token with the prefix loaded from a snapshot file vs cold
  ttft-peer     cold and warm time to first token (1008 stored + 16 new), jaxsmol vs --peer-url
  serve         a `jaxsmol serve` daemon (and --peer-url) under N concurrent streaming clients: tok/s,
                TTFT and inter-token latency, with and without long prompts arriving
  first-burst   a fresh daemon's first burst of clients, with and without compiling ahead
  cluster       replicas behind sglang-router, cache_aware against round_robin: tenants with few-shot
                prefixes of their own (completions, then multi-turn chat); prefix hit rate, prefilled
                tokens, requests/s, TTFT (`cluster.py`; its workload and clients: `tenants.py`)
  admission     a few-shot workload through daemons admitting by longest cached prefix (lpm) and by
                arrival (fifo): time to first token p50/p99 side by side
  speculate     one stream's tokens/s with speculation against plain decoding (copy-heavy prompts, a JSON
                schema, open text), acceptance, outputs equal; with --peer-url llama.cpp's on the same texts

TTFT here is what a caller sees: from `PrefixCache.start` (lookup, gather, restore) to the first
token, the snapshot save of a cold request included. Timings on a shared machine are noisy: the JSON
records the load average before and after.

Files: `plans.py` (what each section runs, quick and full, and the flags of the --only sections),
`measure.py` (timers, warmup, one measurement), `sections.py` (the default sections), `hf.py` (the
transformers harness), one module per --only section (`forks.py`, `prompt_cache.py`, `ttft_peer.py`,
`serve.py`, `first_burst.py`, `admission.py`, `speculate.py`: its measurement, table and plot panel), `clients.py` (the
HTTP clients: streaming completions, a prompt-cache server), `daemon.py` (a `jaxsmol serve` on a free
loopback port), `report.py` (the tables), `plot.py` (the PNG), `run.py` (the entry point, `run_bench`).
"""
