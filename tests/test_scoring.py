"""Prompt scoring (jaxsmol/runtime/scoring.py, `jaxsmol score`) and the daemon's worker (cli/server/worker.py)
on the tiny config: per-choice cache use, plain-data results, prompt log-probabilities equal cold and warm. The real
model's scores are checked against the Hugging Face reference fixture."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.runtime.scoring import log_softmax, score

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "fixtures" / "hf_reference.json"
TOL = 1e-3


def test_score_is_the_log_softmax_of_the_previous_position(tiny_engine):
    ids = [5, 17, 3, 250, 9, 9, 40]
    scores = score(tiny_engine, ids, top_k=4)
    lp = log_softmax(tiny_engine.logits_all(ids))
    assert len(scores) == len(ids) and [s.token for s in scores] == ids
    assert scores[0].logprob is None and scores[0].top is None and scores[0].as_dict() is None
    for p in range(1, len(ids)):
        s = scores[p]
        assert s.logprob == pytest.approx(lp[p - 1, ids[p]], abs=1e-9)
        want = np.argsort(-lp[p - 1], kind="stable")[:4]
        assert [i for i, _ in s.top] == want.tolist()
        assert [v for _, v in s.top] == pytest.approx(lp[p - 1, want].tolist(), abs=1e-9)
        assert s.rank == 1 + int((lp[p - 1] > lp[p - 1, ids[p]]).sum())
    assert score(tiny_engine, ids)[3].top == ()


@pytest.mark.parametrize("ids,top_k", [([], 0), ([1, 300], 0), ([1, 2], 21), ([1, 2], -1)])
def test_score_refuses_bad_input(tiny_engine, ids, top_k):
    with pytest.raises(JaxsmolError):
        score(tiny_engine, ids, top_k)


# ---- the worker, on the tiny engine --------------------------------------------------------------------
@pytest.fixture
def worker_loop():
    """(loop, start_worker): an event loop on its own thread (the jobs' events live there) and
    start_worker(cache) -> a started Worker; all stopped after the test."""
    from jaxsmol.cli.server.metrics import Metrics
    from jaxsmol.cli.server.worker import Worker

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    workers = []

    def start_worker(cache):
        workers.append(Worker(cache, 8, Metrics()))
        workers[-1].start()
        return workers[-1]

    yield loop, start_worker
    for w in workers:
        w.stop()
        w.join(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


async def _events_until_end(job) -> list:
    from jaxsmol.cli.api.events import JobEnd

    events = []
    while not isinstance(events[-1:] and events[-1], JobEnd):
        events.append(await asyncio.wait_for(job.events.get(), 60))
    return events


@pytest.fixture
def run_job(worker_loop):
    """run_job(cache, choices, salt=None) -> the job's events, in order (the worker thread runs it)."""
    from jaxsmol.cli.api.events import Job

    loop, start_worker = worker_loop

    def run(cache, choices, salt=None):
        job = Job(choices=choices, salt=salt, bypass=False, loop=loop)
        start_worker(cache).submit(job)
        return asyncio.run_coroutine_threadsafe(_events_until_end(job), loop).result(120)
    return run


def test_worker_results_are_plain_data_with_per_choice_cache_use(tiny_engine, run_job):
    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.cache.scheduler.requests import ChoiceResult, Timings
    from jaxsmol.cli.api.events import ChoiceDone, ChoiceSpec, JobEnd, TokenEvent

    cache = PrefixCache(tiny_engine)
    prompt = list(range(3, 40))
    sp = SamplingParams(max_tokens=3, temperature=0.0)
    events = run_job(cache, [ChoiceSpec(0, prompt, sp, prompt_logprobs=2), ChoiceSpec(1, prompt, sp)])
    assert isinstance(events[-1], JobEnd)
    done = [e.result for e in events if isinstance(e, ChoiceDone)]
    assert [r.index for r in done] == [0, 1]
    for r in done:
        assert type(r) is ChoiceResult  # plain data: no device buffer, no cache state
        assert all(isinstance(getattr(r, f), (int, float, str, list, Timings, type(None)))
                   for f in r.__dataclass_fields__)
        assert r.output_ids == [e.step.token for e in events if isinstance(e, TokenEvent) and e.index == r.index]
    # both choices are forks of one cold prefill: nothing came from the cache, for either
    assert (done[0].cached_tokens, done[1].cached_tokens) == (0, 0)
    assert cache.stats.tokens_prefilled == len(prompt)  # prefilled once for the two choices
    assert done[0].output_ids == done[1].output_ids
    assert done[1].prompt_logprobs is None
    cold = done[0].prompt_logprobs
    assert cold[0] is None and len(cold) == len(prompt)
    want = score(tiny_engine, prompt, 2)
    assert [e["logprob"] for e in cold[1:]] == [s.logprob for s in want[1:]]

    # prompt log-probabilities are the same whatever the cache holds: here a prefix of the prompt is cached
    warm = run_job(cache, [ChoiceSpec(0, prompt + [7, 8], sp, prompt_logprobs=2)])
    result = next(e.result for e in warm if isinstance(e, ChoiceDone))
    assert result.cached_tokens == len(prompt)
    fresh = run_job(PrefixCache(tiny_engine, mode="off"), [ChoiceSpec(0, prompt + [7, 8], sp, prompt_logprobs=2)])
    assert result.prompt_logprobs == next(e.result for e in fresh if isinstance(e, ChoiceDone)).prompt_logprobs
    assert result.prompt_logprobs[:len(prompt)] == cold


def test_worker_reports_bad_input_on_the_job(tiny_engine, run_job):
    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.cli.api.events import ChoiceSpec, JobEnd, JobError

    events = run_job(PrefixCache(tiny_engine), [ChoiceSpec(0, [1, 10**6], SamplingParams(max_tokens=1))])
    assert isinstance(events[0], JobError) and isinstance(events[0].error, JaxsmolError)
    assert isinstance(events[-1], JobEnd)


def test_a_long_prompts_scores_run_a_chunk_between_the_batchs_steps(tiny_engine, worker_loop, monkeypatch):
    """A request asking for a 300-token prompt's log-probabilities is scored a chunk per worker round:
    a stream decoding meanwhile gets a step between every two chunks (scored at once, the scoring
    held it for all of them); the scores are the ones `score` gives."""
    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.cache.scheduler.scheduler import Scheduler
    from jaxsmol.cli.api.events import ChoiceDone, ChoiceSpec, Job, TokenEvent
    from jaxsmol.cli.server.prompt_scores import PromptScores
    from jaxsmol.runtime.engine import SCORE_ROWS

    order = []
    advance, step = PromptScores.advance, Scheduler.step
    monkeypatch.setattr(PromptScores, "advance", lambda self: (order.append("chunk"), advance(self))[1])
    monkeypatch.setattr(Scheduler, "step", lambda self: (order.append("step"), step(self))[1])
    loop, start_worker = worker_loop
    worker = start_worker(PrefixCache(tiny_engine, mode="off"))
    long = [(7 * i) % 250 + 3 for i in range(300)]
    stream = Job(choices=[ChoiceSpec(0, list(range(3, 20)), SamplingParams(max_tokens=400, temperature=0.0,
                                                                            ignore_eos=True))],
                 salt=None, bypass=False, loop=loop)
    scored = Job(choices=[ChoiceSpec(0, long, SamplingParams(max_tokens=1), prompt_logprobs=3)],
                 salt=None, bypass=False, loop=loop)
    worker.submit(stream)
    asyncio.run_coroutine_threadsafe(stream.events.get(), loop).result(60)  # it decodes
    worker.submit(scored)
    events = asyncio.run_coroutine_threadsafe(_events_until_end(scored), loop).result(120)
    stream.cancelled.set()
    chunks = [i for i, what in enumerate(order) if what == "chunk"]
    assert len(chunks) == -(-len(long) // SCORE_ROWS)
    assert all(order[a + 1] == "step" for a in chunks[:-1])  # the stream stepped between every two chunks
    result = next(e.result for e in events if isinstance(e, ChoiceDone))
    assert result.prompt_logprobs[1:] == [s.as_dict() for s in score(tiny_engine, long, 3)[1:]]
    assert not any(isinstance(e, TokenEvent) and e.index != 0 for e in events)


# ---- the real model against transformers ---------------------------------------------------------------
@pytest.mark.real
def test_scores_match_hf_reference(real_engine):
    ref = json.loads(FIXTURE.read_text(encoding="utf-8"))
    worst = 0.0
    for case in ref["cases"]:
        ids = case["prompt_ids"] + case["greedy_ids"]
        scores = score(real_engine, ids, top_k=ref["top_k"])
        for p in range(1, len(ids)):
            top = case["full_top"][p - 1]  # the reference's distribution after ids[:p]
            mine = dict(scores[p].top)
            for i, v in zip(top["ids"], top["logprobs"]):
                if i in mine:
                    worst = max(worst, abs(mine[i] - v))
            if ids[p] in top["ids"]:
                worst = max(worst, abs(scores[p].logprob - top["logprobs"][top["ids"].index(ids[p])]))
            # the top-5 values agree in order even where near-ties swap ids
            assert np.abs(np.array([v for _, v in scores[p].top]) - np.array(top["logprobs"])).max() <= TOL
    assert worst <= TOL, worst


@pytest.mark.real
def test_score_cli(tiny_model_dir):  # the command's behaviour, on the two-layer checkpoint (real tokenizer)
    def run(*args):
        return subprocess.run([sys.executable, "-m", "jaxsmol.cli.main", "score", "--model", str(tiny_model_dir),
                               *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
    p = run("--ids", "504", "3575", "282", "4649", "314", "--top-k", "2", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["ids"] == [504, 3575, 282, 4649, 314] and out["token_logprobs"][0] is None
    assert len(out["top_logprobs"][1]) == 2 and out["sum_logprob"] == pytest.approx(sum(out["token_logprobs"][1:]))
    p = run("The capital of France is", "--top-k", "2")
    assert p.returncode == 0 and "sum of log-probabilities" in p.stdout, p.stderr
    header, rule, first, second = p.stdout.splitlines()[:4]
    assert header.split() == ["pos", "id", "logprob", "rank", "token", "most", "likely", "there"]
    assert set(rule) == {"-", " "} and first.split()[2:4] == ["-", "-"]  # the first token: nothing before it
    assert second.split()[0] == "1" and float(second.split()[2]) <= 0 and int(second.split()[3]) >= 1
    for bad in (["--ids", "1", "999999"], ["hi", "--top-k", "99"], []):
        p = run(*bad)
        assert p.returncode == 2 and p.stderr.startswith("error: ") and len(p.stderr.splitlines()) == 1, p.stderr


def test_an_idle_worker_admits_a_burst_arriving_ms_apart_together(tiny_engine, worker_loop):
    """Jobs arriving a few ms apart at an idle worker are admitted in its first step (ARRIVAL_GAP_S):
    four prompts of 20 tokens share one side-by-side forward, where the first alone would have run
    its own before the other three arrived."""
    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.cli.api.events import ChoiceSpec, Job
    from jaxsmol.cli.server.worker import ARRIVAL_GAP_S

    loop, start_worker = worker_loop
    worker = start_worker(PrefixCache(tiny_engine, mode="off"))
    time.sleep(0.3)  # idle: waiting for a job
    sp = SamplingParams(max_tokens=2, temperature=0.0)
    jobs = [Job(choices=[ChoiceSpec(0, list(range(3 + i, 23 + i)), sp)], salt=None, bypass=False, loop=loop)
            for i in range(4)]
    for job in jobs:
        worker.submit(job)
        time.sleep(ARRIVAL_GAP_S / 4)
    for job in jobs:
        asyncio.run_coroutine_threadsafe(_events_until_end(job), loop).result(120)
    assert worker.scheduler.stats.admitted == 4
    assert worker.scheduler.stats.prefill_calls == 1  # one forward for the four prompts
