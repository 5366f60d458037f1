"""Prometheus metrics of the daemon, on `prometheus_client` with a registry of its own per app.

Requests are counted by route template: a path that is not one of the daemon's routes counts as
`other`, so a client cannot create series (each distinct label value is a series kept forever).
What this module observes (requests, tokens, time to first token) lives in the library's counters
and histogram; what is counted elsewhere (the worker's cancellations and refusals, the prefix
cache's stats, the queue) is read when /metrics is rendered.
"""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ROUTES = ("/health", "/v1/models", "/metrics", "/v1/cache/flush", "/v1/completions", "/v1/chat/completions")
OTHER = "other"  # the endpoint label of every path that is not a route

# (key of PrefixCache.stats.as_dict(), help) for the counters jaxsmol_cache_<key>_total
CACHE_COUNTERS = (
    ("lookups", "Prefix cache lookups."), ("hits", "Lookups that reused a prefix."),
    ("exact_hits", "Lookups answered with no forward."), ("misses", "Lookups with no reuse."),
    ("saves", "Snapshots saved."), ("restores", "Snapshots restored."),
    ("tokens_reused", "Prompt positions restored instead of prefilled."),
    ("tokens_prefilled", "Prompt positions computed."), ("evictions", "Entries evicted."),
    ("device_hits", "KV arena rows taken for a stored prefix (a request's, an answer's being stored) that held part of "
                    "it already: taken as they were."),
    ("device_tokens", "Positions such rows held: restored with no copy."),
    ("disk_loads", "Entries loaded from the disk tier (--cache-dir)."),
    ("disk_writes", "Entries written to the disk tier."),
    ("shared_loads", "Prefixes restored with chunks of the shared store (--shared-cache)."),
    ("shared_hits", "Chunks read from the shared store and used."),
    ("shared_misses", "Chunk reads that found nothing in the shared store (an unreachable one included)."),
    ("shared_writes", "Chunks written to the shared store."),
    ("shared_bytes_read", "Bytes read from the shared store."),
    ("shared_bytes_written", "Bytes written to the shared store."),
    ("shared_unavailable", "Shared-store reads that found it unreachable."),
    ("shared_skipped", "Lookups that prefilled what the shared store held: reading it was measured slower."),
)


# (key of Scheduler.figures(), help): the continuous batch
BATCH_GAUGES = (("rows", "Decode rows in use."), ("width", "Rows the last decode step computed (live and padding)."),
                ("pending", "Requests waiting for admission."),
                ("kv_bytes", "Resident bytes of the KV arena (the rows of prompts being prefilled, of decode rows, and "
                             "of free rows kept), and of a draft model's arena."),
                ("kv_reserved_bytes", "KV bytes the requests in flight reserve: prompt + max_tokens per row "
                                      "(bounded by --kv-cache-bytes, unless one request alone)."),
                ("draft_cache_bytes", "Bytes held by the draft model's prefix cache (--draft-model)."))
# (key of cli/server/memory.py MemoryAccount.figures(), help): the gauges jaxsmol_<key>
MEMORY_GAUGES = (
    ("weights_bytes", "Bytes of the model's weights."),
    ("programs", "Compiled programs held (every jitted function's, jaxsmol/runtime/programs.py)."),
    ("programs_after_ready", "Programs compiled (or loaded) since the daemon became ready: 0 while every request "
                             "runs on the closed set made ready at start."),
    ("programs_bytes", "Heap bytes the compiled programs hold (measured as they compile ahead; an estimate "
                       "for those compiled on first use)."),
    ("heap_in_use_bytes", "Bytes malloc has handed out (arrays, programs, tokenizer; not Python's small objects; "
                          "the KV arena's reserved span left out: jaxsmol_batch_kv_bytes is its resident part)."),
    ("heap_free_bytes", "Freed bytes malloc keeps for reuse, resident (jaxsmol/system/host_memory.py)."),
    ("resident_bytes", "The process's resident set size."),
    ("resident_at_start_bytes", "The resident set size when the daemon started (weights loaded, nothing "
                                "compiled ahead)."),
    ("unaccounted_bytes", "Resident growth since start that no memory gauge explains (near 0 unless "
                          "something holds memory nobody counts)."),
)
BATCH_COUNTERS = (("steps", "Decode steps."), ("decoded_tokens", "Tokens sampled by decode steps."),
                  ("stalled", "Decode steps a row sat out: its next KV grant did not fit --kv-cache-bytes."),
                  ("prefilled_tokens", "Prompt positions computed by the scheduler."))
READ_PHASES = ("headers", "body")  # where a request's read timed out (cli/server/limits.py)
# the reasons a disk-tier file is refused (cache/store/snapshot.py SnapshotError.reason)
DISK_REFUSALS = ("checksum", "corrupted", "unreadable", "mismatch")
# why a shared-store value is refused when read, and why a chunk is not written (cache/store/shared.py)
SHARED_REFUSALS = ("truncated", "checksum", "malformed", "foreign")
SHARED_DROPS = ("unavailable", "full", "error", "busy")
# (vLLM's name, attribute of cli/server/replica.py Load, help): the gauges the Gateway API Inference
# Extension reads by default, aliases of the queue, the rows in use and the decode KV in use
VLLM_ALIASES = (
    ("vllm:num_requests_waiting", "waiting", "Requests waiting: queued or waiting for admission (vLLM's name)."),
    ("vllm:num_requests_running", "running", "Requests being prefilled or decoded (vLLM's name)."),
    ("vllm:kv_cache_usage_perc", "kv_usage", "Share of --kv-cache-bytes the running requests' positions take, "
                                             "0..1 (vLLM's name)."),
)


class Metrics:
    """The daemon's metrics. `cancelled`, `rejected_queue_full` and `read_timeouts` are plain counts
    that the worker, the handlers and the HTTP protocol increment; `render` gives the Prometheus text
    format."""

    def __init__(self, routes: Iterable[str] = ROUTES):
        self.routes = frozenset(routes)
        self.cancelled = 0
        self.rejected_queue_full = 0
        self.read_timeouts: Tally = Tally()  # READ_PHASES -> connections closed
        self.registry = CollectorRegistry()
        self._requests = Counter("jaxsmol_requests", "HTTP requests by endpoint and status.",
                                 ["endpoint", "status"], registry=self.registry)
        self._prompt_tokens = Counter("jaxsmol_prompt_tokens", "Prompt tokens of finished generations.",
                                      registry=self.registry)
        self._completion_tokens = Counter("jaxsmol_completion_tokens", "Generated tokens.", registry=self.registry)
        self._ttft = Histogram("jaxsmol_time_to_first_token_seconds", "Time to first token of each generation.",
                               buckets=TTFT_BUCKETS, registry=self.registry)
        self._lock = threading.Lock()  # one render at a time: the collector reads the values it was given
        self._scrape = _ScrapeTime(self)
        self.registry.register(self._scrape)

    def endpoint(self, path: str) -> str:
        """The label of a request path: its route, or OTHER."""
        return path if path in self.routes else OTHER

    def request(self, path: str, status: int) -> None:
        self._requests.labels(self.endpoint(path), str(int(status))).inc()

    def read_timed_out(self, phase: str) -> None:
        """A request's headers or body did not arrive within --read-timeout: its connection was closed."""
        self.read_timeouts[phase] += 1

    def observe(self, prompt_tokens: int, completion_tokens: int, ttft_s: float) -> None:
        """Count a finished choice."""
        self._prompt_tokens.inc(prompt_tokens)
        self._completion_tokens.inc(completion_tokens)
        if completion_tokens:
            self._ttft.observe(ttft_s)

    def render(self, cache_stats: dict, queue_depth: int, batch: dict | None = None,
               pool_bytes: int | None = None, memory: dict | None = None, load=None) -> str:
        """Every metric in the Prometheus text format, with the cache's stats, the queue depth, the
        scheduler's figures (`batch`: rows, width, kv_bytes, steps, decoded_tokens, prefilled_tokens),
        the bytes of the engine's recycled cache buffers (`pool_bytes`, Engine.pool_bytes) and the
        memory account's figures (`memory`, MEMORY_GAUGES) and the replica's load (`load`, a
        cli/server/replica.py Load: VLLM_ALIASES)."""
        with self._lock:
            self._scrape.values = (cache_stats, queue_depth, batch or {}, pool_bytes, memory or {}, load)
            try:
                return generate_latest(self.registry).decode()
            finally:
                self._scrape.values = None


def _speculation(by_source: dict):
    """The speculation counters, by the drafts' source (cache/scheduler/speculation.py SOURCES)."""
    from jaxsmol.cache.scheduler.speculation import SOURCES

    for i, (name, help_) in enumerate((("drafted", "Drafted tokens verified (--speculate), by where they came from."),
                                       ("accepted", "Drafted tokens accepted (each the token plain decoding "
                                                    "produced there), by where they came from."))):
        family = CounterMetricFamily(f"jaxsmol_speculation_{name}_tokens", help_, labels=["source"])
        for source in SOURCES:
            family.add_metric([source], by_source.get(source, (0, 0))[i])
        yield family


class _ScrapeTime:
    """A collector of the values read at render time: the worker's counts, the cache's stats, the queue."""

    def __init__(self, metrics: Metrics):
        self.metrics, self.values = metrics, None

    def describe(self):
        return []  # names known only when collected; nothing to check at registration

    def collect(self):
        m = self.metrics
        yield CounterMetricFamily("jaxsmol_cancelled", "Generations stopped because the client left.",
                                  value=m.cancelled)
        yield CounterMetricFamily("jaxsmol_rejected", "Requests refused with 503 (queue full).",
                                  value=m.rejected_queue_full)
        yield _by_label("jaxsmol_read_timeouts", "Connections closed because a request's headers or body did not "
                        "arrive within --read-timeout, by phase.", "phase", m.read_timeouts, READ_PHASES)
        if self.values is None:
            return
        stats, queue_depth, batch, pool_bytes, memory, load = self.values
        yield GaugeMetricFamily("jaxsmol_queue_depth", "Requests waiting for the model.", value=queue_depth)
        if load is not None:
            for name, attr, help_ in VLLM_ALIASES:
                yield GaugeMetricFamily(name, help_, value=getattr(load, attr))
        if pool_bytes is not None:
            yield GaugeMetricFamily("jaxsmol_pool_bytes", "Bytes of finished cache buffers kept for reuse "
                                    "(bounded: jaxsmol/runtime/buffers.py), and restore's host staging buffers.",
                                    value=pool_bytes)
        for key, help_ in BATCH_GAUGES:
            if key in batch:
                yield GaugeMetricFamily(f"jaxsmol_batch_{key}", help_, value=batch[key])
        for key, help_ in MEMORY_GAUGES:
            if key in memory:
                yield GaugeMetricFamily(f"jaxsmol_{key}", help_, value=memory[key])
        for key, help_ in BATCH_COUNTERS:
            if key in batch:
                yield CounterMetricFamily(f"jaxsmol_batch_{key}", help_, value=batch[key])
        if "speculation" in batch:
            yield from _speculation(batch["speculation"])
        for key, help_ in CACHE_COUNTERS:
            yield CounterMetricFamily(f"jaxsmol_cache_{key}", help_, value=stats[key])
        yield _by_label("jaxsmol_cache_bypasses", "Requests that bypassed the cache, by reason.", "reason",
                        stats["bypasses"])
        yield _by_label("jaxsmol_cache_disk_refused", "Disk-tier files refused when read, and deleted, by reason "
                        "(--cache-dir).", "reason", stats["disk_refused"], DISK_REFUSALS)
        yield _by_label("jaxsmol_cache_shared_refused", "Shared-store values refused when read, and deleted, by "
                        "reason (--shared-cache).", "reason", stats["shared_refused"], SHARED_REFUSALS)
        yield _by_label("jaxsmol_cache_shared_dropped", "Chunks not written to the shared store, by reason.", "reason",
                        stats["shared_dropped"], SHARED_DROPS)
        yield GaugeMetricFamily("jaxsmol_cache_bytes", "Bytes held by the prefix cache.", value=stats["bytes_held"])
        yield GaugeMetricFamily("jaxsmol_cache_pinned_bytes", "Bytes of pinned prefixes (part of jaxsmol_cache_bytes; "
                                "bounded by --pinned-bytes).", value=stats.get("pinned_bytes", 0))
        yield GaugeMetricFamily("jaxsmol_cache_disk_bytes", "Bytes held by the disk tier.", value=stats["disk_bytes"])
        yield GaugeMetricFamily("jaxsmol_cache_disk_queued_bytes", "Bytes of snapshots waiting for the disk tier's "
                                "writer thread (at most 256 MiB).", value=stats.get("disk_queued_bytes", 0))
        yield GaugeMetricFamily("jaxsmol_cache_fetched_bytes", "Bytes read ahead from the lower tiers for requests "
                                "waiting for admission.", value=stats.get("fetched_bytes", 0))


def _by_label(name: str, help_: str, label: str, counts: dict, always: Iterable[str] = ()) -> CounterMetricFamily:
    """A counter family with one sample per label value counted, and those `always` shown (0 or not)."""
    family = CounterMetricFamily(name, help_, labels=[label])
    for value in sorted(set(always) | set(counts)):
        family.add_metric([value], counts.get(value, 0))
    return family
