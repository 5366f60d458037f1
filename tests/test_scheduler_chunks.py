"""The scheduler's prompt rows per step (cache/scheduler/scheduler.py, cache/scheduler/settings.py), on the tiny
config: a step's budget (--prefill-chunk) while rows decode, the chunks a prompt gets from it, the
shortest prompt first; every answer still bitwise its run alone."""

from __future__ import annotations

from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.scheduler.requests import Collector, Request
from jaxsmol.cache.scheduler.scheduler import Scheduler
from jaxsmol.runtime.sampling import SamplingParams

from scheduler_runs import prompts, run_alone


def test_a_burst_of_short_prompts_joins_several_per_step(tiny_engine):
    """Up to PREFILLS_AT_ONCE prompts are admitted in one step, each in its least padded chunks (30
    tokens in 32 rows, 40 in 32 + 16, 20 in 32, ...): six short prompts all get their first token
    and one decode step in the first step."""
    sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=8, chunk_rows=128)
    sinks = [Collector() for _ in range(6)]
    for p, sink in zip(prompts(9, [30, 40, 50, 20, 60, 10]), sinks):
        sched.submit(Request(p, [SamplingParams(max_tokens=20)], sink))
    admitted, streamed = [], []
    for _ in range(3):
        sched.step()
        admitted.append(sched.live_rows)
        streamed.append([len(s.steps.get(0, [])) for s in sinks])
    assert admitted == [6, 6, 6]
    assert streamed[0] == [2] * 6  # each: its first token from the prefill, then one decode step
    assert streamed[2] == [4] * 6
    sched.run()
    assert all(len(s.results[0].output_ids) == 20 for s in sinks)


def test_chunk_rows_64_advances_a_long_prompt_32_rows_per_step_exactly(tiny_engine):
    """--prefill-chunk 64: while a row decodes, a long prompt's chunks are 32 rows (so a decode step
    waits on half as much), and its answer is still bitwise its run alone (32-row chunks are exact
    with the CPU kernels)."""
    short, long_ = prompts(12, [10, 200])
    sp = SamplingParams(max_tokens=4, logprobs=2)
    sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=4, batch_invariant=True, chunk_rows=64)
    first, second = Collector(), Collector()
    sched.submit(Request(short, [SamplingParams(max_tokens=60)], first))
    sched.step()
    sched.submit(Request(long_, [sp], second))
    positions = []
    while not second.steps:
        sched.step()
        positions += [sched.arena.pos[p.row] for p in sched.prefills]
    assert positions[:3] == [32, 64, 96] and sched.live_rows == 2
    sched.run()
    got, alone = second.results[0], run_alone(tiny_engine, long_, sp)[0]
    assert got.output_ids == alone.output_ids and got.logprobs == alone.logprobs
    assert len(first.results[0].output_ids) == 60


def test_chunk_rows_48_caps_the_prompt_rows_of_a_step_beside_decoding_rows(tiny_engine):
    """--prefill-chunk 48: beside a decoding row a prompt runs at most 48 rows a step (exact 32-, 16-
    and 8-row chunks): a long prompt advances 32 a step, a 40-token newcomer finishes in one step as
    32 + 8 rows, its 32 side by side with the long prompt's; both answers are bitwise their runs
    alone."""
    streaming, long_, short = prompts(15, [10, 200, 40])
    sp = SamplingParams(max_tokens=3, logprobs=2)
    sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=4, batch_invariant=True, chunk_rows=48)
    steps, run_group = [[]], sched._prefill_group

    def counted(group):  # each step's forwards: the prompt lengths of the chunks side by side, and their rows
        steps[-1].append(sorted((len(p.lookup.prompt), sched.engine.chunk_rows(sched._rows_left(p), rows))
                                for p, rows in group))
        run_group(group)
    sched._prefill_group = counted
    first, slow, quick = Collector(), Collector(), Collector()
    sched.submit(Request(streaming, [SamplingParams(max_tokens=60)], first))
    sched.step()
    sched.submit(Request(long_, [sp], slow))
    steps = [[]]  # from here on, beside the decoding row
    sched.step()
    sched.submit(Request(short, [sp], quick))
    while not slow.steps:
        steps.append([])
        sched.step()
    assert steps[0] == [[(200, 32)]]
    assert steps[1] == [[(40, 32), (200, 32)], [(40, 8)]]  # side by side, then the newcomer's rest
    assert all(s == [[(200, 32)]] for s in steps[2:-1]) and sum(len(s) for s in steps) == 8
    sched.run()
    for got, prompt in [(slow, long_), (quick, short)]:
        alone = run_alone(tiny_engine, prompt, sp)[0]
        assert got.results[0].output_ids == alone.output_ids and got.results[0].logprobs == alone.logprobs
    assert len(first.results[0].output_ids) == 60


def test_a_budget_below_the_smallest_exact_chunk_still_advances_prompts(tiny_cfg, monkeypatch):
    """Without the CPU kernels (a mesh, or no C++ compiler) exact chunks start at 64 rows; a
    --prefill-chunk of 32 then runs 64-row chunks beside a decoding row rather than never prefilling."""
    from jaxsmol.kernels import cpu_kernels
    from jaxsmol.runtime.engine import Engine
    from jaxsmol.model.params import init_random

    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    engine = Engine(tiny_cfg, init_random(tiny_cfg), None, ctx=1024)
    assert not engine.cfg.cpu_kernels and engine.buckets(True)[0] == 64
    streaming, long_ = prompts(16, [10, 150])
    sched = Scheduler(PrefixCache(engine, mode="off"), max_batch=2, chunk_rows=32)
    first, second = Collector(), Collector()
    sched.submit(Request(streaming, [SamplingParams(max_tokens=30)], first))
    sched.step()
    sched.submit(Request(long_, [SamplingParams(max_tokens=2)], second))
    steps = 0
    while not second.steps:
        sched.step()
        steps += 1
    assert steps == 3 and first.steps  # 150 tokens as 64 + 64 + 64 rows, one chunk a step
    sched.run()
    assert len(second.results[0].output_ids) == 2 and len(first.results[0].output_ids) == 30


def test_a_short_prompt_overtakes_a_long_one_being_prefilled(tiny_engine):
    """A short newcomer is prefilled beside a long prompt already in progress, shortest first, and
    gets its first token long before the long one; both answers are bitwise their runs alone."""
    streaming, long_, short = prompts(13, [10, 300, 20])
    sp = SamplingParams(max_tokens=3, logprobs=2)
    sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=4, batch_invariant=True, chunk_rows=64)
    first, slow, quick = Collector(), Collector(), Collector()
    sched.submit(Request(streaming, [SamplingParams(max_tokens=40)], first))
    sched.step()
    sched.submit(Request(long_, [sp], slow))
    sched.step()
    sched.submit(Request(short, [sp], quick))
    steps = 0
    while not quick.steps:
        sched.step()
        steps += 1
    assert steps == 1 and not slow.steps and len(sched.prefills) == 1  # 20 rows: one chunk
    sched.run()
    for got, prompt in [(slow, long_), (quick, short)]:
        alone = run_alone(tiny_engine, prompt, sp)[0]
        assert got.results[0].output_ids == alone.output_ids and got.results[0].logprobs == alone.logprobs


def test_a_prompt_alone_runs_128_rows_a_step_so_a_newcomer_waits_little(tiny_engine):
    """With no row decoding a step prefills 128 rows, not a whole 512-row chunk, so a newcomer's
    prompt runs in the next step (ahead of the long one, being shorter)."""
    long_, short = prompts(14, [300, 20])
    sp = SamplingParams(max_tokens=3)
    sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=4)
    slow, quick = Collector(), Collector()
    sched.submit(Request(long_, [sp], slow))
    sched.step()
    assert [sched.arena.pos[p.row] for p in sched.prefills] == [128]
    sched.submit(Request(short, [sp], quick))
    sched.step()
    assert quick.steps and not slow.steps
    sched.run()
    assert len(slow.results[0].output_ids) == 3


def test_a_one_token_request_takes_no_decode_row(tiny_engine):
    """A choice of max_tokens 1 is sampled from its prompt's logits and never decodes, so it holds no
    row: with the only row busy it is still answered, and while its long prompt is prefilled a
    streaming newcomer takes the row that frees up rather than waiting for that prompt to finish."""
    streaming, long_, late = prompts(17, [10, 400, 20])
    sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=1, chunk_rows=48)
    first, one, second = Collector(), Collector(), Collector()
    sched.submit(Request(streaming, [SamplingParams(max_tokens=4)], first))
    sched.step()
    sched.submit(Request(long_, [SamplingParams(max_tokens=1, logprobs=2)], one))
    sched.submit(Request(late, [SamplingParams(max_tokens=8)], second))
    while not first.results:
        sched.step()
    assert sched.prefills and not one.results  # the long prompt is still being prefilled, beside the row
    sched.step()
    assert second.steps and not one.results  # the newcomer took the freed row ahead of the long prompt
    sched.run()
    got, alone = one.results[0], run_alone(tiny_engine, long_, SamplingParams(max_tokens=1, logprobs=2))[0]
    assert got.output_ids == alone.output_ids and got.logprobs == alone.logprobs
    assert len(second.results[0].output_ids) == 8 and sched.stats.steps > 0
