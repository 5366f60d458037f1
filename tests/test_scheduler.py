"""Continuous batching (cache/scheduler/scheduler.py): many requests in one decode batch, on the tiny config.

The contract: under batch_invariant a request's tokens and logprobs are identical alone or among
others; requests join and leave while others decode; n samples of one prompt prefill it once; the
prompt state is still bitwise what a cold prefill computes; compiled programs stay bounded."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.scheduler.requests import Collector, Request
from jaxsmol.cache.scheduler.many import generate_many
from jaxsmol.cache.scheduler.settings import widths_for
from jaxsmol.cache.scheduler.scheduler import Scheduler
from jaxsmol.cache.scheduler.settings import arena_rows
from jaxsmol.runtime import programs
from jaxsmol.runtime.sampling import SamplingParams

from scheduler_runs import prompts, run_alone


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


def test_a_burst_decodes_at_the_narrowest_width_within_its_memory(tiny_engine):
    """Six requests at once decode in six rows of the arena at width 8 (the ladder 1, 2, 4, 8), nothing
    moved; every row goes back when they are done; with a KV budget for four requests' reservations
    (prompt + max_tokens each) four are admitted first and the others wait."""
    bpt = tiny_engine.kv_bytes_per_token
    sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=8)
    for p in prompts(9, [30, 40, 50, 20, 60, 10]):
        sched.submit(Request(p, [SamplingParams(max_tokens=20)], Collector()))
    sched.step()
    assert sched.live_rows == 6 and sched.width == 8 and len({r.slot for r in sched.rows}) == 6
    sched.run()
    assert sched.width == 0 and sched.arena.free_rows == sched.arena.pad and sched.arena.check_in_place()
    tight = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=8, kv_bytes=(50 + 60 + 70 + 40) * bpt)
    for p in prompts(9, [30, 40, 50, 20, 60, 10]):
        tight.submit(Request(p, [SamplingParams(max_tokens=20)], Collector()))
    tight.step()
    assert tight.live_rows == 4 and len(tight.pending) == 2 and tight.reserved_slots * bpt <= tight.kv_bytes
    tight.run()


def test_rows_are_granted_kv_as_they_grow_and_sit_out_steps_past_the_budget(tiny_engine):
    """Four requests asking for 300 tokens each under a budget of about two of them: all four are
    admitted on their first grant (prompt + GROW_SLOTS), rows past their grant get more while it fits,
    the others sit steps out while the oldest request goes on, the grants stay within the budget but
    for that one, and every answer is its run alone, bit for bit."""
    from jaxsmol.cache.scheduler.requests import GROW_SLOTS

    bpt, sp = tiny_engine.kv_bytes_per_token, SamplingParams(max_tokens=300, temperature=0.8, seed=5, ignore_eos=True)
    budget = 4 * (20 + GROW_SLOTS) + 8
    sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=4, batch_invariant=True, kv_bytes=budget * bpt,
                      speculate="none")
    ps, sinks = prompts(60, [20, 20, 20, 20]), [Collector() for _ in range(4)]
    for p, sink in zip(ps, sinks):
        sched.submit(Request(p, [sp], sink))
    sched.step()
    assert sched.live_rows == 4
    while sched.has_work:
        sched.step()
        oldest = sched.rows[0].reserved if sched.rows else 0
        assert sched.granted_slots <= budget + oldest  # only the oldest request's grant may pass it
    assert sched.stats.stalled > 0
    for p, sink in zip(ps, sinks):
        assert sink.results[0].output_ids == run_alone(tiny_engine, p, sp)[0].output_ids


def test_choices_fork_as_their_kv_fits_and_equal_their_runs_alone(tiny_engine):
    """Eight choices of a 200-token prompt under a budget of about three of their grants: the prompt is
    prefilled once, the first choice decodes in its row, the others fork from it as grants free up
    (one takes a finished sibling's row over as it is), the grants never pass the budget, and every
    choice's tokens are its run alone's."""
    from jaxsmol.cache.scheduler.requests import GROW_SLOTS

    bpt = tiny_engine.kv_bytes_per_token
    sps = [SamplingParams(max_tokens=40 + 10 * i, temperature=0.9, seed=i, ignore_eos=True) for i in range(8)]
    budget = 3 * (200 + GROW_SLOTS) + 16
    sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=8, batch_invariant=True, kv_bytes=budget * bpt,
                      speculate="none")
    [prompt], sink = prompts(61, [200]), Collector()
    sched.submit(Request(prompt, sps, sink))
    waited = 0
    while sched.has_work:
        sched.step()
        waited = max(waited, len(sched.forks))
        assert sched.granted_slots <= budget and sched.live_rows <= 3
    assert waited >= 4 and sched.stats.prefilled_tokens == 200 and not sink.errors
    for i, sp in enumerate(sps):
        assert sink.results[i].output_ids == run_alone(tiny_engine, prompt, sp)[0].output_ids


def test_free_rows_keep_their_pages_within_the_budget_and_give_them_back_when_idle(tiny_engine, monkeypatch):
    """After a burst its rows keep their pages (the next burst writes the same memory, with the tokens
    a fresh scheduler gives), up to RETAIN_SHARE of the budget (a tight budget trims them, least
    recently used first, and more when new requests reserve room); once idle for IDLE_RELEASE_S they go
    back to the OS (the arena's resident pages fall to its slabs' edges)."""
    from jaxsmol.cache.scheduler import kv_budget
    from jaxsmol.cache.scheduler import scheduler as scheduler_module

    def burst(sched, seed, n):
        sinks = [Collector() for _ in range(n)]
        for p, sink in zip(prompts(seed, [20 + 7 * i for i in range(n)]), sinks):
            sched.submit(Request(p, [SamplingParams(max_tokens=12, temperature=1.0, seed=seed)], sink))
        sched.run()
        return [sink.results[0].output_ids for sink in sinks]

    sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=8)
    arena = sched.arena
    arena.release(range(arena.pad))
    burst(sched, 31, 4)
    kept = arena.slots_held(free=True)  # each prompt and the 11 tokens written after it (not the last)
    assert kept >= 20 + 27 + 34 + 41 + 4 * 11 and arena.resident_bytes() >= kept * arena.bytes_per_slot // 2
    again = burst(sched, 32, 4)
    assert arena.slots_held(free=True) <= kept + 4 * 12  # the same rows' pages, written again
    assert again == burst(Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=8), 32, 4)
    monkeypatch.setattr(scheduler_module, "IDLE_RELEASE_S", 0.0)
    sched.idle()
    sched.idle()
    L, R, K, _, _ = arena.shape
    edges = 2 * L * R * K * 2 * 4096  # each slab's first and last page may be shared with the next one
    assert arena.slots_held() == 0 and arena.resident_bytes() <= edges
    budget = 400
    tight = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=8,
                      kv_bytes=budget * tiny_engine.kv_bytes_per_token)
    burst(tight, 33, 4)  # its rows wrote ~170 slots: the most recently given back kept, up to 100
    assert 0 < tight.arena.slots_held(free=True) <= kv_budget.RETAIN_SHARE * budget
    for p in prompts(34, [200, 27]):
        tight.submit(Request(p, [SamplingParams(max_tokens=12)], Collector()))
    tight.step()  # their admission trimmed the free rows' pages to what the budget leaves
    assert tight.arena.slots_held(free=True) + tight.reserved_slots <= budget
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
    warm_logits = warm_cache.store.match(ns, second).payload
    cold_logits = cold_cache.store.match(cold_cache.namespace(), second).payload
    assert warm_logits is not None and np.array_equal(warm_logits, cold_logits)


def test_answers_are_stored_for_the_next_turn(tiny_engine):
    """... from the prompt's own row, and the next turn starts from the answer's, neither copied in (a
    take of the arena's returns a row holding them), with the bits of a cold run."""
    cache = PrefixCache(tiny_engine, mode="radix")
    prompt = prompts(8, [80])[0]
    arena = tiny_engine.arena(arena_rows(16))  # generate_many's
    taken = arena.taken_holding
    [[first]] = generate_many(cache, [prompt], SamplingParams(max_tokens=20))
    follow_up = prompt + first.output_ids + prompts(9, [10])[0]
    [[second]] = generate_many(cache, [follow_up], SamplingParams(max_tokens=2))
    assert second.cached_tokens == len(prompt) + len(first.output_ids)
    assert arena.taken_holding == taken + 3  # both answers' stores and the second turn's restore
    cold_cache = PrefixCache(tiny_engine, mode="radix")
    [[cold]] = generate_many(cold_cache, [follow_up], SamplingParams(max_tokens=2))
    assert cold.cached_tokens == 0 and cold.output_ids == second.output_ids
    stored = [c.store.match(c.namespace(), follow_up).payload for c in (cache, cold_cache)]
    assert stored[0] is not None and np.array_equal(*stored)


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


def test_arena_rows_restore_fork_read_and_release_against_numpy(tiny_engine):
    """A KV arena's rows against NumPy: a prefix restored from parts of several lengths reads back as
    their concatenation, at any window; a fork copies it with its exact positions and tag; a take of a
    row holding a prefix keeps what it is told; a released row's pages go back to the OS; every program
    updated the arena in place."""
    from jaxsmol.runtime.kv_arena import KVArena

    arena, rng = KVArena(tiny_engine, 3), np.random.default_rng(4)
    L, _, K, _, H = arena.shape
    parts = [{name: rng.standard_normal((L, 1, K, n, H)).astype(np.float32) for name in ("k", "v")}
             for n in (100, 200, 37)]
    whole = {name: np.concatenate([p[name] for p in parts], axis=3) for name in ("k", "v")}
    row = arena.take()
    arena.restore(row, parts, 0, 337, exact=True)
    arena.tags[row] = "the taker's"
    for start, stop in [(0, 337), (250, 300), (255, 257)]:
        got = arena.segment(row, start, stop)
        assert all(np.array_equal(got[n], whole[n][:, :, :, start:stop]) for n in ("k", "v"))
    other = arena.take()
    assert other != row and arena.exact[other] == 0 and arena.tags[other] is None
    arena.fork(row, other, 300)
    assert np.array_equal(arena.segment(other, 0, 300)["v"], whole["v"][:, :, :, :300])
    assert (arena.exact[other], arena.tags[other]) == (300, "the taker's")
    arena.give(row)
    with pytest.raises(ValueError, match="does not hold 338"):
        arena.take(row, 338)
    again = arena.take(row, 300)
    assert again == row and arena.pos[row] == arena.exact[row] == 300 and arena.tags[row] is None
    assert arena.taken_holding >= 1
    arena.give(again)
    held = arena.resident_bytes()
    slab_edges = 2 * L * K * 2 * 4096  # a slab's first and last page may be shared with its neighbours
    assert arena.release([again]) >= 2 * L * K * 337 * H * 4 - slab_edges  # the 337 slots the restore wrote
    assert arena.resident_bytes() <= held - 2 * L * K * 337 * H * 4 + slab_edges
    assert arena.exact[again] == 0 and arena.touched[again] == 0 and arena.check_in_place()


def test_programs_do_not_depend_on_lengths_or_fields(tiny_engine):
    """A mixed workload (prompts of 2-400 tokens, logprobs on and off, several choices) through a
    max_batch 8 scheduler compiles at most one decode program per width: lengths and fields are data."""
    assert widths_for(8) == (1, 2, 4, 8) and widths_for(6) == (1, 2, 4, 6)
    before = programs.compiled_count("decode_step")
    cache = PrefixCache(tiny_engine, mode="radix")
    sched = Scheduler(cache, max_batch=8)
    rng = np.random.default_rng(10)
    for _wave in range(3):
        for n in rng.integers(2, 400, size=5):
            sched.submit(Request(prompts(int(n), [int(n)])[0],
                                 [SamplingParams(max_tokens=int(rng.integers(1, 30)), logprobs=int(n) % 3)]
                                 * int(1 + n % 2), Collector()))
        for _ in range(int(rng.integers(3, 20))):
            sched.step()
    sched.run()
    assert programs.compiled_count("decode_step") - before <= len(widths_for(8))


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

    from jaxsmol.runtime.structured import canonical_spec

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


BATCHED_PROGRAMS = ("decode_step", "sample_first", "prefill_rows", "write_slots", "copy_row", "read_slots")


def _burst_prepares(cfg, ahead: bool) -> set[str]:
    """Which arena programs a burst of four short requests makes ready (compiles, or loads from the
    program store where an earlier run left them) on a fresh engine of cfg, after
    Scheduler.compile_programs when `ahead`. Their prompts' chunks run side by side with the kernels,
    and their answers end at different steps, so the batch runs at widths 4, then 2 and 1."""
    from jaxsmol.cache.scheduler.compile_ahead import scheduler_calls
    from jaxsmol.runtime import programs
    from jaxsmol.runtime.engine import Engine
    from jaxsmol.model.params import init_random

    sched = Scheduler(PrefixCache(Engine(cfg, init_random(cfg), None, ctx=1024), mode="off"), max_batch=4,
                      speculate="none")
    if ahead:
        assert sched.compile_programs() == len(scheduler_calls(sched))
    sinks = [Collector() for _ in range(4)]
    before = {name: programs.ALL[name].prepared for name in BATCHED_PROGRAMS}
    for p, n, sink in zip(prompts(12, [40, 9, 70, 25]), [30, 3, 4, 5], sinks):
        sched.submit(Request(p, [SamplingParams(max_tokens=n, logprobs=n % 2)], sink))
    sched.run()
    assert all(len(s.results[0].output_ids) == n for s, n in zip(sinks, [30, 3, 4, 5]))
    return {name for name in BATCHED_PROGRAMS if programs.ALL[name].prepared > before[name]}


def test_programs_compiled_ahead_are_the_ones_a_burst_runs():
    """The daemon compiles the scheduler's programs before it is ready (compile_programs, from shapes
    alone): a burst of requests then makes none ready. Without it the same burst makes them ready
    (compiles them, or loads them where an earlier run stored them) as it meets each. Each burst has a
    config of its own shapes (layers for the cache, vocabulary for the sampling), so no earlier test
    in this process made its programs ready."""
    from jaxsmol.model.config import Config

    assert _burst_prepares(Config.tiny(n_layers=3, vocab_size=288), False) == {"decode_step", "sample_first",
                                                                               "prefill_rows"}
    assert _burst_prepares(Config.tiny(n_layers=4, vocab_size=320), True) == set()
