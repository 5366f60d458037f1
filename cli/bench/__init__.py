"""`jaxsmol bench`: prefill and decode speed, prefix-cache time to first token, snapshot memory,
compilations and a fresh process's first token; optionally side by side with Hugging Face.

Every timed section runs after the programs it needs are compiled (compile time is excluded, except
in the fresh-process section, whose point is compile time), and reports the median of its repeats.
Sections:

  compilations  forward programs compiled by a mixed workload through the radix cache, vs compile_bound.
                Runs first, so that the count starts from a process that has compiled nothing.
  prefill       tokens/s of a cold prefill (no cache) of n tokens
  decode        tokens/s of decode steps at a short and a long position
  ttft          time to first token, cold (first request on an empty cache) vs warm (a prompt sharing a
                prefix with it) vs an exact full hit (the same prompt again), and the headline row
                (1008-token shared prefix + 16 new tokens) for each cache mode
  snapshot      bytes held by the radix store for n branches sharing a trunk, vs n full copies
  cli           a fresh `jaxsmol generate` process, without and with the persistent compilation cache
  hf            (--compare hf) the same prefill, decode and prefix reuse with Hugging Face transformers

TTFT here is what a caller sees: from `PrefixCache.start` (lookup, gather, restore) to the first
token, the snapshot save of a cold request included. Timings on a shared machine are noisy: the JSON
records the load average before and after.

Files: `plans.py` (what each section runs, quick and full), `measure.py` (timers, warmup, one
measurement), `sections.py` (the sections), `hf.py` (the transformers harness), `report.py` (the
tables), `plot.py` (the PNG), `run.py` (the entry point, `run_bench`).
"""
