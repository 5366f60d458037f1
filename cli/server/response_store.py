"""The Responses API's stored responses (`store: true`): held in memory, bounded in count and bytes, the
oldest evicted first, each readable only by the tenant (cache namespace) that made it.

A stored response keeps the object answered (GET /v1/responses/{id}) and the conversation a chained
request continues (`previous_response_id`): its turns and its answer as chat-template messages, and
its prompt_cache_key, so that the next turn's prompt lies in the same cache namespace. Nothing is
written to disk: a restart forgets them.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

DEFAULT_MAX_COUNT = 1024
DEFAULT_MAX_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class Stored:
    namespace: str | None  # the tenant's (None: the default, no API keys)
    response: dict
    conversation: tuple  # chat-template messages: the turns and the answer, without the instructions
    cache_key: str | None
    inputs: int  # this request's input messages: the last ones before the answer
    size: int  # bytes, as JSON


class ResponseStore:
    def __init__(self, max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: collections.OrderedDict[str, Stored] = collections.OrderedDict()  # oldest first
        self.bytes = self.evicted = 0
        self._lock = threading.Lock()  # routes run on the event loop; a metrics scrape reads from its thread

    def put(self, namespace: str | None, response: dict, conversation: list[dict], cache_key: str | None,
            inputs: int) -> None:
        """Keep a response, evicting the oldest past the bounds; one larger than max_bytes alone is not kept."""
        size = len(json.dumps(response)) + len(json.dumps(conversation))  # ASCII JSON: its length is its bytes
        if size > self.max_bytes:
            return
        with self._lock:
            self._items[response["id"]] = Stored(namespace, response, tuple(conversation), cache_key, inputs, size)
            self.bytes += size
            while len(self._items) > self.max_count or self.bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self.bytes -= old.size
                self.evicted += 1

    def get(self, namespace: str | None, response_id: str) -> Stored | None:
        """The tenant's stored response, or None (unknown, deleted, evicted, or another tenant's)."""
        stored = self._items.get(response_id)
        return stored if stored is not None and stored.namespace == namespace else None

    def delete(self, namespace: str | None, response_id: str) -> bool:
        with self._lock:
            stored = self.get(namespace, response_id)
            if stored is None:
                return False
            del self._items[response_id]
            self.bytes -= stored.size
            return True

    # a Prometheus collector (registered on the daemon's registry)
    def describe(self):
        return []

    def collect(self):
        yield GaugeMetricFamily("jaxsmol_responses_stored", "Responses API responses stored (store: true).",
                                value=len(self._items))
        yield GaugeMetricFamily("jaxsmol_responses_stored_bytes", "Bytes of the stored responses, as JSON.",
                                value=self.bytes)
        yield CounterMetricFamily("jaxsmol_responses_evicted", "Stored responses evicted (the oldest, past the "
                                  "count or byte bound).", value=self.evicted)
