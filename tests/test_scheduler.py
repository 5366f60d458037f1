"""Continuous batching (cache/scheduler.py): many requests in one decode batch, on the tiny config.

The contract: under batch_invariant a request's tokens and logprobs are identical alone or among
others; requests join and leave while others decode; n samples of one prompt prefill it once; the
prompt state is still bitwise what a cold prefill computes; compiled programs stay bounded."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cache.prefix_cache import PrefixCache
from cache.requests import Collector, Request
from cache.many import generate_many
from cache.batch_settings import widths_for
from cache.scheduler import Scheduler
from jaxsmol import programs
from jaxsmol.engine import capacity_for
from jaxsmol.sampling import SamplingParams


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 256, size=n)] for n in lengths]


def run_alone(engine, prompt, sp, **kw):
    return generate_many(PrefixCache(engine, mode="off"), [prompt], sp, batch_invariant=True, max_batch=4, **kw)[0]


MIXED = [SamplingParams(max_tokens=9, logprobs=3),
         SamplingParams(max_tokens=14, temperature=0.8, seed=7, logprobs=2),
         SamplingParams(max_tokens=11, temperature=1.2, top_k=20, seed=3),
         SamplingParams(max_tokens=13, temperature=0.9, top_p=0.7, seed=11, stop_ids=(5, 6, 7)),
         SamplingParams(max_tokens=1),
         SamplingParams(max_tokens=20, temperature=1.0, top_k=5, top_p=0.9, seed=2**40 + 5, logprobs=1)]


def test_batched_equals_alone_under_batch_invariant(tiny_engine):
    """Six requests of mixed lengths and sampling settings through 4 rows (so they join as rows free
    up): each one's tokens, text-free results and logprobs equal its run alone, bit for bit."""
    ps = prompts(0, [5, 70, 130, 300, 64, 9])
    sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=4, batch_invariant=True)
    sinks = [Collector() for _ in ps]
    for p, sp, sink in zip(ps, MIXED, sinks):
        sched.submit(Request(p, [sp], sink))
    sched.run()
    for p, sp, sink in zip(ps, MIXED, sinks):
        got, alone = sink.results[0], run_alone(tiny_engine, p, sp)[0]
        assert not sink.errors
        assert got.output_ids == alone.output_ids and got.finish_reason == alone.finish_reason
        assert got.logprobs == alone.logprobs  # exact floats, top ids included
        assert [s.token for s in sink.steps[0]] == got.output_ids
        assert len(got.output_ids) <= sp.max_tokens


def test_stop_ids_and_lengths_end_rows(tiny_engine):
    sp = dataclasses.replace(MIXED[3], max_tokens=40)
    [res] = run_alone(tiny_engine, prompts(1, [50])[0], sp)
    if res.finish_reason == "stop":
        assert res.output_ids[-1] in sp.stop_ids and not set(res.output_ids[:-1]) & set(sp.stop_ids)
    else:
        assert len(res.output_ids) == 40 and not set(res.output_ids) & set(sp.stop_ids)
    [res] = run_alone(tiny_engine, prompts(1, [50])[0], SamplingParams(max_tokens=0))
    assert res.output_ids == [] and res.finish_reason == "length"


def test_requests_join_while_others_decode(tiny_engine):
    """A request submitted mid-stream is admitted and streams before the running one finishes."""
    sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=4)
    first, second = Collector(), Collector()
    p1, p2 = prompts(2, [40, 200])
    sched.submit(Request(p1, [SamplingParams(max_tokens=30)], first))
    for _ in range(5):
        sched.step()
    assert len(first.steps[0]) == 6 and not first.results  # step 1: prefill, first token, one decode
    sched.submit(Request(p2, [SamplingParams(max_tokens=5)], second))
    while not second.results:
        sched.step()
        assert sched.live_rows <= 2
    assert not first.results  # the second finished while the first was still decoding
    sched.run()
    assert len(first.results[0].output_ids) == 30 and len(second.results[0].output_ids) == 5


def test_a_burst_of_short_prompts_joins_several_per_step(tiny_engine):
    """Prompt chunks fill the step's row budget (chunk_rows = 128), down to the smallest exact chunk
    (16 rows), each prompt in its least padded chunks: 30 tokens in 32 rows, 40 in 32 + 16, 20 in 32,
    then 16 rows of the 50-token prompt; the next step finishes it and admits the other two."""
    sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=8, chunk_rows=128)
    sinks = [Collector() for _ in range(6)]
    for p, sink in zip(prompts(9, [30, 40, 50, 20, 60, 10]), sinks):
        sched.submit(Request(p, [SamplingParams(max_tokens=20)], sink))
    admitted, streamed = [], []
    for _ in range(3):
        sched.step()
        admitted.append(sched.live_rows)
        streamed.append([len(s.steps.get(0, [])) for s in sinks])
    assert admitted == [3, 6, 6]
    assert streamed[0] == [2, 2, 2, 0, 0, 0]  # each: its first token from the prefill, then one decode step
    assert streamed[2] == [4, 4, 4, 3, 3, 3]
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
        positions += [int(p.kv.pos) for p in sched.prefills]
    assert positions[:3] == [32, 64, 96] and sched.live_rows == 2
    sched.run()
    got, alone = second.results[0], run_alone(tiny_engine, long_, sp)[0]
    assert got.output_ids == alone.output_ids and got.logprobs == alone.logprobs
    assert len(first.results[0].output_ids) == 60


def test_chunk_rows_48_caps_the_prompt_rows_of_a_step_beside_decoding_rows(tiny_engine):
    """--prefill-chunk 48: beside a decoding row a step runs at most 48 prompt rows (exact 32- and
    16-row chunks), a long prompt advances 32 a step, a 40-token newcomer finishes in one step as
    32 + 16 rows; both answers are bitwise their runs alone."""
    streaming, long_, short = prompts(15, [10, 200, 40])
    sp = SamplingParams(max_tokens=3, logprobs=2)
    sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=4, batch_invariant=True, chunk_rows=48)
    ran, chunk = [0], sched._prefill_chunk

    def counted(p, max_rows):  # the rows (padding included) each step's chunks ran
        rows = chunk(p, max_rows)
        ran[-1] += rows
        return rows
    sched._prefill_chunk = counted
    first, slow, quick = Collector(), Collector(), Collector()
    sched.submit(Request(streaming, [SamplingParams(max_tokens=60)], first))
    sched.step()
    sched.submit(Request(long_, [sp], slow))
    ran = [0]  # from here on, beside the decoding row
    sched.step()
    sched.submit(Request(short, [sp], quick))
    while not slow.steps:
        ran.append(0)
        sched.step()
    assert ran[0] == 32 and max(ran) == 48 and sum(ran) == 208 + 48
    sched.run()
    for got, prompt in [(slow, long_), (quick, short)]:
        alone = run_alone(tiny_engine, prompt, sp)[0]
        assert got.results[0].output_ids == alone.output_ids and got.results[0].logprobs == alone.logprobs
    assert len(first.results[0].output_ids) == 60


def test_a_budget_below_the_smallest_exact_chunk_still_advances_prompts(tiny_cfg):
    """Without the CPU kernels (bfloat16 weights) exact chunks start at 64 rows; a --prefill-chunk of
    32 then runs 64-row chunks beside a decoding row rather than never prefilling."""
    import jax.numpy as jnp
    from jaxsmol.engine import Engine
    from jaxsmol.params import init_random

    engine = Engine(tiny_cfg, init_random(tiny_cfg, dtype=jnp.bfloat16), None, ctx=1024)
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
    assert [int(p.kv.pos) for p in sched.prefills] == [128]
    sched.submit(Request(short, [sp], quick))
    sched.step()
    assert quick.steps and not slow.steps
    sched.run()
    assert len(slow.results[0].output_ids) == 3


def test_a_burst_grows_the_batch_once_within_its_memory(tiny_engine):
    """Six requests at once: the batch grows straight to the width they need (one move of the live
    rows, not one per rung of 1, 2, 4, 8), but never past kv_bytes."""
    sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=8)
    for p in prompts(9, [30, 40, 50, 20, 60, 10]):
        sched.submit(Request(p, [SamplingParams(max_tokens=20)], Collector()))
    sched.step()
    assert len(sched.rows) == 8 and sched.stats.relayouts == 1
    sched.run()
    assert sched.stats.relayouts <= 2  # and shrinking back once the rows finish
    per_row = capacity_for(60 + 20) * tiny_engine.kv_bytes_per_token
    tight = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=8, kv_bytes=4 * per_row)
    for p in prompts(9, [30, 40, 50, 20, 60, 10]):
        tight.submit(Request(p, [SamplingParams(max_tokens=20)], Collector()))
    tight.step()
    assert len(tight.rows) == 4 and tight.kv_bytes_held <= 4 * per_row
    tight.run()


def test_a_cancelled_request_frees_its_row_for_the_next(tiny_engine):
    sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=2)
    sinks = [Collector() for _ in range(3)]
    for p, sink in zip(prompts(3, [20, 30, 40]), sinks):
        sched.submit(Request(p, [SamplingParams(max_tokens=50)], sink))
    for _ in range(6):
        sched.step()
    assert sched.live_rows == 2 and not sinks[2].steps  # the third waits for a row
    sinks[0].cancel = True
    for _ in range(4):
        sched.step()
    assert sinks[2].steps and sched.live_rows == 2  # admitted into the freed row
    sched.run()
    assert not sinks[0].results and len(sinks[0].steps[0]) < 50
    assert len(sinks[1].results[0].output_ids) == 50 and len(sinks[2].results[0].output_ids) == 50


def test_n_samples_prefill_the_prompt_once(tiny_engine):
    cache = PrefixCache(tiny_engine, mode="radix")
    sched = Scheduler(cache, max_batch=8)
    prompt = prompts(4, [100])[0]
    [results] = generate_many(cache, [prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=1), n=8,
                              scheduler=sched)
    assert sched.stats.prefilled_tokens == 100  # not 800
    assert len(results) == 8 and all(r.cached_tokens == 0 for r in results)  # cold, for every choice
    assert len({tuple(r.output_ids) for r in results}) > 1  # seeds seed + i: different samples
    again = generate_many(cache, [prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=1), n=2,
                          scheduler=sched)[0]
    assert all(r.cached_tokens == 100 for r in again)  # an exact full hit, for both choices
    assert [r.output_ids for r in again] == [r.output_ids for r in results[:2]]
    assert sched.stats.prefilled_tokens == 100


def test_cached_prompt_state_is_bitwise_cold_with_batching(tiny_engine):
    """Prompt logits (stored with each prompt) are identical whether a prefix came from the cache or
    not, with other rows decoding meanwhile."""
    base = prompts(5, [300])[0]
    warm_cache = PrefixCache(tiny_engine, mode="radix")
    sched = Scheduler(warm_cache, max_batch=4)
    busy = Collector()
    sched.submit(Request(prompts(6, [30])[0], [SamplingParams(max_tokens=60)], busy))
    generate_many(warm_cache, [base], SamplingParams(max_tokens=3), scheduler=sched)
    second = base[:200] + prompts(7, [77])[0]
    [[warm]] = generate_many(warm_cache, [second], SamplingParams(max_tokens=3), scheduler=sched)
    assert warm.cached_tokens == 200
    cold_cache = PrefixCache(tiny_engine, mode="radix")
    [[cold]] = generate_many(cold_cache, [second], SamplingParams(max_tokens=3))
    assert warm.output_ids == cold.output_ids
    ns = warm_cache.namespace()
    warm_logits = warm_cache.radix.match(ns, second).payload
    cold_logits = cold_cache.radix.match(cold_cache.namespace(), second).payload
    assert warm_logits is not None and np.array_equal(warm_logits, cold_logits)


def test_answers_are_stored_for_the_next_turn(tiny_engine):
    cache = PrefixCache(tiny_engine, mode="radix")
    prompt = prompts(8, [80])[0]
    [[first]] = generate_many(cache, [prompt], SamplingParams(max_tokens=20))
    follow_up = prompt + first.output_ids + prompts(9, [10])[0]
    [[second]] = generate_many(cache, [follow_up], SamplingParams(max_tokens=2))
    assert second.cached_tokens == len(prompt) + len(first.output_ids)


def test_a_next_turn_sent_at_once_waits_for_the_answer_to_be_stored(tiny_engine):
    """A follow-up that arrives while the answer it continues is still being stored reuses it: that
    save runs before the follow-up is admitted."""
    cache = PrefixCache(tiny_engine, mode="radix")
    sched = Scheduler(cache, max_batch=4)
    first, second = Collector(), Collector()
    prompt = prompts(11, [90])[0]
    sched.submit(Request(prompt, [SamplingParams(max_tokens=20)], first))
    while not first.results:
        sched.step()
    assert sched.saves  # the answer is not stored yet
    answer = first.results[0].output_ids
    sched.submit(Request(prompt + answer + [9, 9], [SamplingParams(max_tokens=2)], second))
    sched.run()
    assert second.results[0].cached_tokens == len(prompt) + len(answer)


def test_answers_are_stored_when_no_row_decodes(tiny_engine):
    """Storing an answer is speculative work: it waits while other rows decode, then runs."""
    cache = PrefixCache(tiny_engine, mode="radix")
    sched = Scheduler(cache, max_batch=4)
    short, long = Collector(), Collector()
    a, b = prompts(12, [70, 70])
    sched.submit(Request(a, [SamplingParams(max_tokens=3, ignore_eos=True)], short))
    sched.submit(Request(b, [SamplingParams(max_tokens=30, ignore_eos=True)], long))
    while not short.results:
        sched.step()
    while not long.results:
        assert sched.saves  # the short answer waits while the long one decodes
        sched.step()
    sched.run()
    assert not sched.saves
    answer = short.results[0].output_ids
    [[follow]] = generate_many(cache, [a + answer + [5]], SamplingParams(max_tokens=1), scheduler=sched)
    assert follow.cached_tokens == len(a) + len(answer)


def test_widths_and_compiled_programs_are_bounded(tiny_engine):
    """A mixed workload through a max_batch 8 scheduler compiles at most one decode program per
    (width, capacity, logprobs) and one insert per (width, capacity, row capacity)."""
    assert widths_for(8) == (1, 2, 4, 8) and widths_for(6) == (1, 2, 4, 6)
    before = programs.compiled_count("decode_step")
    cache = PrefixCache(tiny_engine, mode="radix")
    sched = Scheduler(cache, max_batch=8)
    rng = np.random.default_rng(10)
    for wave in range(3):
        for n in rng.integers(2, 400, size=5):
            sched.submit(Request(prompts(int(n), [int(n)])[0],
                                 [SamplingParams(max_tokens=int(rng.integers(1, 30)), logprobs=int(n) % 2)],
                                 Collector()))
        for _ in range(int(rng.integers(3, 20))):
            sched.step()
    sched.run()
    capacities = {capacity_for(s) for s in (512, 1024)}
    assert programs.compiled_count("decode_step") - before <= len(widths_for(8)) * len(capacities) * 2


def test_too_many_choices_is_a_clear_error(tiny_engine):
    sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=2)
    sink = Collector()
    sched.submit(Request([1, 2, 3], [SamplingParams()] * 3, sink))
    assert "at most 2 choices" in str(sink.errors[0])
    sink = Collector()
    sched.submit(Request([1, 2, 999], [SamplingParams()], sink))
    sched.run()
    assert "outside" in str(sink.errors[0]) and not sched.has_work


@pytest.mark.real
def test_structured_output_rows_beside_free_rows(real_engine):
    """Rows with a JSON schema (greedy and sampled) and a free row decode in one batch: the masked
    rows' outputs parse and validate, the free row is unaffected by their masks."""
    import json

    import jsonschema

    from jaxsmol.structured import canonical_spec

    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 16},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    spec = canonical_spec({"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    tok = real_engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Invent a person; answer in JSON."}]))
    sched = Scheduler(PrefixCache(real_engine), max_batch=4)
    settings = [SamplingParams(max_tokens=40, structured=spec),
                SamplingParams(max_tokens=40, temperature=0.9, seed=3, structured=spec),
                SamplingParams(max_tokens=12)]
    sinks = [Collector() for _ in settings]
    for sp, sink in zip(settings, sinks):
        sched.submit(Request(prompt, [sp], sink))
    sched.run()
    for sink in sinks[:2]:
        result = sink.results[0]
        assert result.finish_reason == "stop", result.text
        jsonschema.validate(json.loads(result.text), schema)
    [[free]] = generate_many(PrefixCache(real_engine, mode="off"), [prompt], settings[2])
    assert sinks[2].results[0].output_ids == free.output_ids
