"""Prompts prefilled side by side (jaxsmol/runtime/batch.py prefill_rows over rows of the KV arena, the
scheduler's grouping): one forward for several prompts' chunks, every row with the bits of its
prompt's lone chunk, so cached == uncached still holds bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.scheduler.requests import Collector, Request
from jaxsmol.cache.scheduler.scheduler import Scheduler
from jaxsmol.cache.scheduler.side_by_side import GROUP_SIZES, MAX_ROWS, group_chunks, group_sizes
from jaxsmol.runtime.kv_arena import KVArena
from jaxsmol.runtime.sampling import SamplingParams

from scheduler_runs import prompts, run_alone


def _started(arena, prompt, start):
    """A row of `arena` holding prompt[:start], computed alone (as a restored prefix would be)."""
    row = arena.take()
    if start:
        arena.fill(row, prompt[:start])
    return row


def _assert_side_by_side_bits(engine, T, seed):
    """Three prompts at different positions (0, a 16-row prefix, a 70-token prefix), with fewer
    real tokens than T in two of them: each prompt's logits and row equal its lone chunk's, bitwise,
    and a row beside them is left as it was."""
    assert engine.side_by_side
    arena = KVArena(engine, 8)
    ps = prompts(seed, [T - 5, 16 + T, 70 + T // 2])
    starts = [0, 16, 70]
    lone = []
    for p, s in zip(ps, starts):
        row = _started(arena, p, s)
        lone.append((arena.prefill([(row, p)], T, exact_rows=True)[0], row))
    bystander = _started(arena, ps[2], 70)
    before = arena.segment(bystander, 0, 70)
    rows = [_started(arena, p, s) for p, s in zip(ps, starts)]
    logits = arena.prefill(list(zip(rows, ps)), T, exact_rows=True)
    assert logits.shape == (3, engine.cfg.vocab_size)
    for i, (lone_logits, lone_row) in enumerate(lone):
        n = arena.pos[lone_row]
        assert arena.pos[rows[i]] == n == min(len(ps[i]), starts[i] + T)
        np.testing.assert_array_equal(np.asarray(logits[i]), np.asarray(lone_logits))
        got, want = arena.segment(rows[i], 0, n), arena.segment(lone_row, 0, n)
        np.testing.assert_array_equal(got["k"], want["k"])
        np.testing.assert_array_equal(got["v"], want["v"])
    after = arena.segment(bystander, 0, 70)
    assert np.array_equal(after["k"], before["k"]) and np.array_equal(after["v"], before["v"])
    assert arena.check_in_place()


@pytest.mark.parametrize("T", [16, 32, 64])
def test_side_by_side_rows_have_their_lone_chunks_bits(tiny_engine, T):
    _assert_side_by_side_bits(tiny_engine, T, 40 + T)


def test_side_by_side_rows_have_their_lone_chunks_bits_on_the_real_model(real_engine):
    _assert_side_by_side_bits(real_engine, 32, 44)


def test_chunks_are_grouped_by_shape_up_to_most():
    """Chunks of one (rows, capacity) share a forward, at most `most` to a group and at most
    MAX_ROWS rows long; the rest run alone; order is kept within a group."""
    chunks = [("a", 32, 512), ("b", 16, 512), ("c", 32, 512), ("d", 64, 512), ("e", 32, 1024),
              ("f", 32, 512), ("g", 64, 512)]
    groups = group_chunks(chunks, lambda c: (c[1], c[2]), 2)
    assert [[c[0] for c in g] for g in groups] == [["a", "c"], ["b"], ["d"], ["e"], ["f"], ["g"]]
    assert len(group_chunks(chunks, lambda c: (c[1], c[2]), 1)) == len(chunks)
    assert MAX_ROWS == 32


def test_groups_are_2_4_or_8_chunks_the_rest_alone():
    """Only groups of GROUP_SIZES run side by side (the programs compiled ahead): 7 chunks of one
    shape run as 4 + 2 + 1, 5 as 4 + 1, 6 under most=6 as 4 + 2; never more than `most` together."""
    def sizes(n, most):
        return [len(g) for g in group_chunks([(i, 16, 512) for i in range(n)], lambda c: (c[1], c[2]), most)]

    assert sizes(7, 8) == [4, 2, 1] and sizes(5, 8) == [4, 1] and sizes(8, 8) == [8] and sizes(3, 8) == [2, 1]
    assert sizes(6, 6) == [4, 2] and sizes(9, 8) == [8, 1] and sizes(3, 2) == [2, 1]
    assert group_sizes(8) == GROUP_SIZES == (2, 4, 8) and group_sizes(3) == (2,) and group_sizes(1) == ()
    order = [c[0] for g in group_chunks([(i, 16, 512) for i in range(7)], lambda c: (c[1], c[2]), 8) for c in g]
    assert order == list(range(7))


def test_a_burst_is_prefilled_side_by_side_and_answers_as_alone(tiny_engine):
    """Six short prompts arriving at once are all admitted in the first step and prefilled in a few
    forwards (chunks of one length side by side), not one or more each; every answer (tokens and
    log-probabilities) is bitwise its run alone."""
    ps = prompts(41, [30, 40, 50, 20, 60, 10])
    sp = SamplingParams(max_tokens=5, logprobs=2)
    sched = Scheduler(PrefixCache(tiny_engine, mode="off"), max_batch=8, batch_invariant=True)
    sinks = [Collector() for _ in ps]
    for p, sink in zip(ps, sinks):
        sched.submit(Request(p, [sp], sink))
    sched.step()
    assert sched.live_rows == 6 and all(s.steps for s in sinks)
    # 10, 20, 30 tokens: one 16-, 32-, 32-row chunk; 40, 50, 60: 32 + 16, 64, 64 rows. First round:
    # the 16, the three 32s as two side by side and one alone (groups of 2, 4 or 8), the two 64s
    # each alone (64-row chunks gain nothing side by side); then 40's 16: 6 forwards for 6 prompts
    # (alone: 7)
    assert sched.stats.prefill_calls == 6
    sched.run()
    for p, sink in zip(ps, sinks):
        alone = run_alone(tiny_engine, p, sp)[0]
        assert sink.results[0].output_ids == alone.output_ids and sink.results[0].logprobs == alone.logprobs


def test_without_the_kernels_prompts_are_prefilled_one_by_one(tiny_cfg, monkeypatch):
    """Without the CPU kernels (XLA's fused attention may change with the batch's shape) no chunks run
    side by side: each prompt gets forwards of its own."""
    from jaxsmol.kernels import cpu_kernels
    from jaxsmol.runtime.engine import Engine
    from jaxsmol.model.params import init_random

    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    engine = Engine(tiny_cfg, init_random(tiny_cfg), None, ctx=1024)
    assert not engine.side_by_side
    sched = Scheduler(PrefixCache(engine, mode="off"), max_batch=4)
    for p in prompts(42, [20, 30]):
        sched.submit(Request(p, [SamplingParams(max_tokens=5)], Collector()))
    sched.step()
    assert sched.live_rows == 2 and sched.stats.prefill_calls == 2
