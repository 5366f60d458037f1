"""cli/server/metrics.py without a server: route-template labels (a crafted path creates no series), counts,
and a render that Prometheus' own parser reads back. Generations come from the tiny engine."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cli.server.metrics import OTHER, ROUTES, TTFT_BUCKETS, Metrics
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.cache.scheduler.many import generate

CRAFTED = [
    "/v1/completions/../x", "/V1/completions", "/v1/completions/", "/metrics?x=1", "/a\"b", "/a}b 1\nfake_metric 7",
    '/x{endpoint="evil"}', "/" + "a" * 5000, "/\u00e9\u2603", "", "/health/", "//health",
] + [f"/random/{i}" for i in range(200)]


def _samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value}, through prometheus_client's parser (fails on bad text)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def served(tiny_engine):
    """(cache, [result]): a cold request and a warm one sharing its prefix, on a fresh cache."""
    cache = PrefixCache(tiny_engine)
    runs = [generate(cache, list(range(10, 40)) + [t], SamplingParams(max_tokens=3)) for t in (50, 51)]
    return cache, runs


def _render(m: Metrics, cache) -> dict[tuple, float]:
    return _samples(m.render(cache.stats.as_dict(), 5))


def test_crafted_paths_create_no_series(served):
    cache, _ = served
    m = Metrics()
    for route in ROUTES:
        m.request(route, 200)
    m.request("/nowhere", 404)
    before = set(_render(m, cache))
    for path in CRAFTED:
        m.request(path, 404)
    after = _render(m, cache)
    assert set(after) == before  # no new series, whatever the paths
    assert after[("jaxsmol_requests_total", (("endpoint", OTHER), ("status", "404")))] == 1 + len(CRAFTED)
    endpoints = {dict(labels)["endpoint"] for name, labels in after if name == "jaxsmol_requests_total"}
    assert endpoints == set(ROUTES) | {OTHER}
    assert not any(name.startswith("fake") for name, _ in after)


def test_counts(served):
    cache, runs = served
    m = Metrics()
    for _ in range(3):
        m.request("/v1/completions", 200)
    m.request("/v1/completions", 400)
    m.cancelled += 2
    m.rejected_queue_full += 1
    for gen in runs:
        m.observe(gen.prompt_tokens, len(gen.output_ids), gen.timings.ttft_s)
    s = _render(m, cache)
    assert s[("jaxsmol_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 3
    assert s[("jaxsmol_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))] == 1
    assert s[("jaxsmol_cancelled_total", ())] == 2 and s[("jaxsmol_rejected_total", ())] == 1
    assert s[("jaxsmol_prompt_tokens_total", ())] == sum(g.prompt_tokens for g in runs) == 62
    assert s[("jaxsmol_completion_tokens_total", ())] == sum(len(g.output_ids) for g in runs)
    assert s[("jaxsmol_queue_depth", ())] == 5
    stats = cache.stats.as_dict()
    assert stats["hits"] >= 1 and stats["tokens_reused"] > 0  # the warm request reused the prefix
    for key in ("lookups", "hits", "misses", "tokens_reused", "tokens_prefilled"):
        assert s[(f"jaxsmol_cache_{key}_total", ())] == stats[key]
    assert s[("jaxsmol_cache_bytes", ())] == stats["bytes_held"] > 0
    ttfts = sorted(g.timings.ttft_s for g in runs)
    for le in TTFT_BUCKETS:
        key = ("jaxsmol_time_to_first_token_seconds_bucket", (("le", str(float(le))),))
        assert s[key] == sum(t <= le for t in ttfts)
    assert s[("jaxsmol_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 2
    assert s[("jaxsmol_time_to_first_token_seconds_count", ())] == 2
    assert s[("jaxsmol_time_to_first_token_seconds_sum", ())] == pytest.approx(sum(ttfts))


def test_render_types_and_independent_registries(served):
    cache, (gen, _) = served
    a, b = Metrics(), Metrics()  # each app has its own registry: no clash, no shared counts
    a.request("/health", 200)
    a.observe(gen.prompt_tokens, len(gen.output_ids), gen.timings.ttft_s)
    stats = dict(cache.stats.as_dict(), bypasses={"prompt has at most one token": 4})
    families = {f.name: f for f in text_string_to_metric_families(a.render(stats, 0))}
    for name, kind in (("jaxsmol_requests", "counter"), ("jaxsmol_cache_bytes", "gauge"),
                       ("jaxsmol_queue_depth", "gauge"), ("jaxsmol_cache_bypasses", "counter"),
                       ("jaxsmol_time_to_first_token_seconds", "histogram")):
        assert families[name].type == kind, name
    bypass = families["jaxsmol_cache_bypasses"].samples
    assert [(x.labels, x.value) for x in bypass] == [({"reason": "prompt has at most one token"}, 4)]
    sb = _samples(b.render(cache.stats.as_dict(), 0))
    assert not any(name == "jaxsmol_requests_total" for name, _ in sb)
    assert sb[("jaxsmol_prompt_tokens_total", ())] == 0
