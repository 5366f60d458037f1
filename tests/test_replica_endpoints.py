"""What a router in front of several daemons calls on each one (cli/server/replica.py): GET /get_load in
SGLang's shape, POST /flush_cache (an alias of /v1/cache/flush, admin-only as it is), /server_info and
/model_info, and vLLM's gauge names on /metrics. In process, on the tiny engine: the worker thread is
not started (no lifespan) unless a test says so, so jobs submitted to it wait in its queue and a
scheduler stepped by hand holds exactly the requests the test put there."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from jaxsmol.cache.scheduler.requests import Collector, Request
from jaxsmol.cli.api.events import ChoiceSpec, Job
from jaxsmol.cli.server.replica import read_load
from jaxsmol.cli.server.serve import create_app
from jaxsmol.cli.server.tenants import Tenants, parse_keys_file
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.cache.scheduler.many import generate

KEYS = "sk-admin - admin\nsk-user\n"


def _job(prompts: list[list[int]], n: int = 1) -> Job:
    specs = [ChoiceSpec(index=i, prompt_ids=p, sampling=SamplingParams(max_tokens=8))
             for i, p in enumerate(q for q in prompts for _ in range(n))]
    return Job(choices=specs, salt=None, bypass=False, loop=asyncio.new_event_loop())


def _gauges(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture
def app(tiny_engine):
    return create_app(tiny_engine, model_name="tiny", max_queue=8)


def test_get_load_counts_queued_pending_and_running_requests(app, tiny_engine):
    client, worker = TestClient(app), app.state.worker
    assert client.get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]

    # one request decoding (20 prompt tokens, its first token sampled), then one waiting in the scheduler
    # and two jobs in the worker's queue (a job's n choices of one prompt count its tokens once)
    running = Request(list(range(10, 30)), [SamplingParams(max_tokens=8)], Collector())
    worker.scheduler.submit(running)
    worker.scheduler.step()
    worker.scheduler.submit(Request(list(range(40, 47)), [SamplingParams(max_tokens=8)], Collector()))
    worker.submit(_job([list(range(50, 55))], n=3))
    worker.submit(_job([list(range(60, 63)), list(range(70, 74))]))

    decoded = len(worker.scheduler.rows[0].stream.output_ids)
    assert decoded >= 1
    held = 20 + decoded
    expected = {"dp_rank": 0, "num_reqs": 4, "num_waiting_reqs": 3, "num_tokens": held + 7 + 5 + 3 + 4}
    assert client.get("/get_load").json() == [expected]

    load = read_load(worker, tiny_engine.kv_bytes_per_token)
    assert (load.running, load.waiting) == (1, 3)
    assert load.kv_used_bytes == held * tiny_engine.kv_bytes_per_token
    assert load.kv_usage == held * tiny_engine.kv_bytes_per_token / worker.scheduler.kv_bytes

    gauges = _gauges(client.get("/metrics").text)  # vLLM's names, as the Gateway API Inference Extension reads
    assert gauges["vllm:num_requests_waiting"] == 3
    assert gauges["vllm:num_requests_running"] == 1
    assert gauges["vllm:kv_cache_usage_perc"] == pytest.approx(load.kv_usage)
    assert 0 < gauges["vllm:kv_cache_usage_perc"] < 1


def test_kv_usage_is_a_share_of_the_kv_budget_at_most_one(tiny_engine):
    from jaxsmol.cache.scheduler.settings import BatchSettings

    bpt = tiny_engine.kv_bytes_per_token
    app = create_app(tiny_engine, model_name="tiny", batch=BatchSettings(kv_bytes=10 * bpt))
    worker = app.state.worker
    worker.scheduler.submit(Request(list(range(10, 30)), [SamplingParams(max_tokens=8)], Collector()))
    worker.scheduler.step()  # one request alone is always admitted, past the budget
    load = read_load(worker, bpt)
    assert load.kv_used_bytes > 10 * bpt and load.kv_usage == 1.0


def test_flush_cache_is_the_cache_flush_and_needs_an_admin_key(tiny_engine):
    app = create_app(tiny_engine, model_name="tiny", tenants=Tenants(parse_keys_file(KEYS)))
    cache = app.state.cache
    with TestClient(app) as client:
        generate(cache, list(range(10, 40)), SamplingParams(max_tokens=2))
        assert cache.stats.as_dict()["bytes_held"] > 0
        assert client.post("/flush_cache").status_code == 401
        r = client.post("/flush_cache", headers={"authorization": "Bearer sk-user"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        assert cache.stats.as_dict()["bytes_held"] > 0
        r = client.post("/flush_cache", headers={"authorization": "Bearer sk-admin"})
        assert r.status_code == 200 and r.json() == {"flushed": True}
        assert cache.stats.as_dict()["bytes_held"] == 0
        _ = generate(cache, list(range(10, 40)), SamplingParams(max_tokens=2))
        report = _.report
        assert report.reused == 0  # forgotten


def test_server_and_model_info_answer_without_a_key(tiny_engine):
    app = create_app(tiny_engine, model_name="tiny", tenants=Tenants(parse_keys_file(KEYS)))
    client = TestClient(app)
    assert client.get("/v1/models").status_code == 401  # the API needs a key; what routers read does not
    for path in ("/server_info", "/get_server_info"):
        info = client.get(path).json()
        assert info["served_model_name"] == "tiny" and info["max_total_tokens"] == tiny_engine.ctx
        assert info["max_running_requests"] == 16 and info["dp_size"] == 1
    for path in ("/model_info", "/get_model_info"):
        info = client.get(path).json()
        assert info["is_generation"] is True and info["architectures"] == ["LlamaForCausalLM"]
    assert client.get("/get_load").status_code == 200


def test_the_new_routes_are_counted_by_name(app):
    client = TestClient(app)
    for path in ("/get_load", "/server_info", "/model_info", "/get_model_info"):
        assert client.get(path).status_code == 200
    samples = {(s.name, s.labels.get("endpoint")): s.value
               for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples}
    for path in ("/get_load", "/server_info", "/model_info", "/get_model_info"):
        assert samples[("jaxsmol_requests_total", path)] == 1
