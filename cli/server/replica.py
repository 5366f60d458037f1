"""What the routers and gateways in front of several daemons read of each one (a replica).

sglang-router (`jaxsmol cluster`, docs/serving.md) calls, on every worker: GET /health at
registration and then periodically (503 while warming: not registered, no traffic), GET /server_info
and /model_info once at registration (metadata; /get_model_info is forwarded from its own route of
that name), GET /get_load (its /get_loads), GET /metrics (its /engine_metrics), POST /flush_cache (its
/flush_cache, on every worker), and forwards /v1/completions and /v1/chat/completions with the
client's Authorization header. `server_info` and `model_info` below are those bodies.

`read_load` takes one snapshot of the worker (cli/server/worker.py) from the HTTP side: the jobs
waiting in its queue, the scheduler's requests waiting for admission, those being prefilled and the
decode rows. It only reads (lists copied before they are walked, the queue under its own lock); the
worker thread may change them meanwhile, so a snapshot can be a step old, which is all a router
needs. Served as:
  GET /get_load   SGLang's shape, which sglang-router reads (one entry per data-parallel rank):
                  [{"dp_rank": 0, "num_reqs", "num_waiting_reqs", "num_tokens"}]
  /metrics        vLLM's gauge names, which the Gateway API Inference Extension reads by default:
                  vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Load:
    """running: requests being prefilled or decoded; waiting: requests queued or waiting for
    admission; tokens: the positions they hold or will (prompts and answers so far); kv_used_bytes:
    the decode rows' and prefills' positions in bytes; kv_budget_bytes: --kv-cache-bytes."""
    running: int
    waiting: int
    tokens: int
    kv_used_bytes: int
    kv_budget_bytes: int

    @property
    def kv_usage(self) -> float:
        """The share of --kv-cache-bytes that running requests' positions take, 0..1 (vLLM's
        kv_cache_usage_perc is such a fraction, despite its name)."""
        return min(1.0, self.kv_used_bytes / self.kv_budget_bytes) if self.kv_budget_bytes > 0 else 0.0

    def sglang(self) -> list[dict]:
        """GET /get_load's body: SGLang's per-rank list (num_reqs counts the waiting ones too)."""
        return [{"dp_rank": 0, "num_reqs": self.running + self.waiting, "num_waiting_reqs": self.waiting,
                 "num_tokens": self.tokens}]


def _queued_prompt_tokens(jobs) -> tuple[int, int]:
    """(jobs, prompt tokens of their distinct prompts) in the worker's queue.Queue, read under its lock."""
    with jobs.mutex:
        queued = list(jobs.queue)
    tokens = sum(len(p) for job in queued for p in {tuple(c.prompt_ids) for c in job.choices})
    return len(queued), tokens


def read_load(worker, kv_bytes_per_token: int) -> Load:
    """One snapshot of the worker's load (see the module docstring)."""
    scheduler = worker.scheduler  # read once: a failed step replaces it
    rows = [r for r in list(scheduler.rows) if r is not None]
    prefills = list(scheduler.prefills)
    pending = list(scheduler.pending)
    queued, queued_tokens = _queued_prompt_tokens(worker.jobs)
    running_requests = {id(r.request) for r in rows} | {id(p.request) for p in prefills}
    held = sum(len(r.lookup.prompt) + len(r.stream.output_ids) for r in rows)
    held += sum(len(p.request.prompt_ids) for p in prefills)
    waiting_tokens = queued_tokens + sum(len(r.prompt_ids) for r in pending)
    return Load(running=len(running_requests), waiting=queued + len(pending), tokens=held + waiting_tokens,
                kv_used_bytes=held * kv_bytes_per_token, kv_budget_bytes=scheduler.kv_bytes)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxsmol")
    except PackageNotFoundError:
        return "unknown"


def _model_path(engine, model_name: str) -> str:
    """The model's directory (a router on the same machine loads the tokenizer from it), else its name."""
    return str(engine.model_dir) if engine.model_dir is not None else model_name


def server_info(engine, model_name: str, max_batch: int) -> dict:
    """GET /server_info (and SGLang's older /get_server_info): the fields sglang-router reads."""
    return {"served_model_name": model_name, "model_path": _model_path(engine, model_name), "version": _version(),
            "max_running_requests": max_batch, "max_total_tokens": engine.ctx, "dp_size": 1}


def model_info(engine, model_name: str) -> dict:
    """GET /model_info (and /get_model_info): what the model is, in SGLang's fields."""
    path = _model_path(engine, model_name)
    return {"model_path": path, "tokenizer_path": path, "is_generation": True,
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_model_len": engine.ctx}
