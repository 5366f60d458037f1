"""Prometheus text metrics for the daemon (a few counters and one histogram, no extra library)."""

from __future__ import annotations

import threading
from collections import Counter

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = Counter()  # (endpoint, status code) -> count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.cancelled = 0
        self.rejected_queue_full = 0
        self.ttft_counts = [0] * len(TTFT_BUCKETS)
        self.ttft_sum = 0.0
        self.ttft_n = 0

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    def observe(self, gen, report, queue_s: float) -> None:
        with self.lock:
            self.prompt_tokens += len(gen.prompt_ids)
            self.completion_tokens += len(gen.output_ids)
            self.cached_tokens += report.reused
            if gen.output_ids:
                t = gen.timings.ttft_s
                self.ttft_sum += t
                self.ttft_n += 1
                for i, le in enumerate(TTFT_BUCKETS):
                    if t <= le:
                        self.ttft_counts[i] += 1

    def render(self, cache_stats: dict, queue_depth: int) -> str:
        lines = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{labels} {value}")

        with self.lock:
            metric("jaxsmol_requests_total", "counter", "HTTP requests by endpoint and status.",
                   [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())])
            metric("jaxsmol_prompt_tokens_total", "counter", "Prompt tokens of finished generations.",
                   [("", self.prompt_tokens)])
            metric("jaxsmol_completion_tokens_total", "counter", "Generated tokens.", [("", self.completion_tokens)])
            metric("jaxsmol_cancelled_total", "counter", "Generations stopped because the client left.",
                   [("", self.cancelled)])
            metric("jaxsmol_rejected_total", "counter", "Requests refused with 503 (queue full).",
                   [("", self.rejected_queue_full)])
            metric("jaxsmol_queue_depth", "gauge", "Requests waiting for the model.", [("", queue_depth)])
            buckets = []
            for le, c in zip(TTFT_BUCKETS, self.ttft_counts):
                buckets.append((f'_bucket{{le="{le}"}}', c))
            buckets.append(('_bucket{le="+Inf"}', self.ttft_n))
            lines.append("# HELP jaxsmol_time_to_first_token_seconds Time to first token of each generation.")
            lines.append("# TYPE jaxsmol_time_to_first_token_seconds histogram")
            for suffix, c in buckets:
                lines.append(f"jaxsmol_time_to_first_token_seconds{suffix} {c}")
            lines.append(f"jaxsmol_time_to_first_token_seconds_sum {self.ttft_sum}")
            lines.append(f"jaxsmol_time_to_first_token_seconds_count {self.ttft_n}")
        s = cache_stats
        for key, help_ in (("lookups", "Prefix cache lookups."), ("hits", "Lookups that reused a prefix."),
                           ("exact_hits", "Lookups answered with no forward."), ("misses", "Lookups with no reuse."),
                           ("saves", "Snapshots saved."), ("restores", "Snapshots restored."),
                           ("tokens_reused", "Prompt positions restored instead of prefilled."),
                           ("tokens_prefilled", "Prompt positions computed."), ("evictions", "Entries evicted."),
                           ("disk_loads", "Entries loaded from the disk tier (--cache-dir)."),
                           ("disk_writes", "Entries written to the disk tier.")):
            metric(f"jaxsmol_cache_{key}_total", "counter", help_, [("", s[key])])
        metric("jaxsmol_cache_bypasses_total", "counter", "Requests that bypassed the cache, by reason.",
               [(f'{{reason="{r}"}}', n) for r, n in sorted(s["bypasses"].items())])
        metric("jaxsmol_cache_bytes", "gauge", "Bytes held by the prefix cache.", [("", s["bytes_held"])])
        metric("jaxsmol_cache_disk_bytes", "gauge", "Bytes held by the disk tier.", [("", s["disk_bytes"])])
        return "\n".join(lines) + "\n"
