"""jaxsmol replicas as a Ray Serve application behind Ray Serve's prefix-aware request router
(`pip install 'jaxsmol[ray]'`; docs/serving.md shows how to run it).

    from ray import serve
    from jaxsmol.cli.ray_serve import build_app

    serve.run(build_app({"replicas": 2, "serve_args": ["--model", "path/to/checkpoint"]}))

or `serve run cli.ray_serve:build_app replicas=2 serve_args="--cache-bytes 200000000"`. Two deployments:

  JaxsmolReplica  `replicas` copies; each runs one `jaxsmol serve` on a free loopback port of its node
                  (cli/replicas.py) with `serve_args`, and its constructor returns once that daemon is
                  ready, so Ray Serve sends a warming replica no request. It relays a call to its daemon
                  and streams the answer back; `check_health` asks the daemon's /health. Its request
                  router is PrefixCacheAffinityRouter: the replica whose past prompts share the longest
                  prefix with the call's text, the replica with the smallest tree when none shares
                  enough, power of two choices when the queues differ much.
  Ingress         the HTTP entry (FastAPI, `@serve.ingress`): it parses the body of /v1/completions and
                  /v1/chat/completions into a call whose `prompt` (or `messages`) the router reads,
                  keeps the client's Authorization header for the daemon (with API keys, each key's
                  prompts stay in its namespace), and streams the daemon's answer back as it comes.

The router class is imported from its module: `ray.serve.llm.request_router.PrefixCacheAffinityRouter`
is the same class, but importing `ray.serve.llm` needs vLLM or SGLang installed. (No `from __future__
import annotations` here: FastAPI must see the handlers' `Request` annotations as classes.)
"""

import dataclasses
import json
import shlex
import tempfile
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.serve.config import RequestRouterConfig

from jaxsmol.cli.replicas import Replica, free_port, serve_command, stop, wait_until

START_TIMEOUT_S = 1800


@dataclasses.dataclass(frozen=True)
class CompletionCall:
    """A request for a daemon (its path, body as sent, Authorization header), which the router places by
    `prompt`: the text it matches against each replica's past prompts."""
    path: str
    raw: bytes
    authorization: str | None
    prompt: str


@dataclasses.dataclass(frozen=True)
class ChatCall:
    """A chat request, which the router places by `messages` (their contents, joined)."""
    path: str
    raw: bytes
    authorization: str | None
    messages: list


def routing_text(body: dict) -> str:
    """The text of a completion's prompt for the router: a string or the strings of a list as they are,
    token ids as their decimal text (a shared prefix of ids stays a shared prefix of text)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return "".join(prompt)
    return " ".join(map(str, prompt)) if isinstance(prompt, list) else ""


def make_call(path: str, raw: bytes, authorization: str | None):
    """The call for the router: by messages for chat, by prompt otherwise; by the path when the body has
    no text (the router divides by the text's length). The daemon gets the body as it was sent, and
    answers a bad one itself."""
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        body = {}
    body = body if isinstance(body, dict) else {}
    messages = body.get("messages")
    if path.endswith("/chat/completions") and isinstance(messages, list) and any(
            isinstance(m, dict) and m.get("content") for m in messages):
        return ChatCall(path, raw, authorization, messages)
    return CompletionCall(path, raw, authorization, routing_text(body) or path)


@serve.deployment(request_router_config=RequestRouterConfig(request_router_class=PrefixCacheAffinityRouter),
                  health_check_period_s=10, health_check_timeout_s=30, graceful_shutdown_timeout_s=120)
class JaxsmolReplica:
    def __init__(self, serve_args: list[str]):
        port = free_port()
        log = Path(tempfile.mkdtemp(prefix="jaxsmol-ray-replica-")) / "serve.log"
        self.daemon = Replica("jaxsmol serve", serve_command(port, serve_args), log, url=f"http://127.0.0.1:{port}")
        self.daemon.start()
        wait_until([self.daemon], Replica.ready, START_TIMEOUT_S, "ready")  # no traffic while it warms
        self.client = httpx.AsyncClient(base_url=self.daemon.url, timeout=1800)

    async def call(self, call):
        """The daemon's answer: first {"status", "content_type"}, then its body in pieces as they come."""
        headers = {"content-type": "application/json"}
        if call.authorization:
            headers["authorization"] = call.authorization
        method = "GET" if call.path == "/v1/models" else "POST"
        content = None if method == "GET" else call.raw
        async with self.client.stream(method, call.path, content=content, headers=headers) as r:
            yield {"status": r.status_code, "content_type": r.headers.get("content-type", "application/json")}
            async for piece in r.aiter_bytes():
                yield piece

    async def check_health(self):
        r = await self.client.get("/health", timeout=10)
        if r.status_code != 200:
            raise RuntimeError(f"jaxsmol serve at {self.daemon.url}: /health {r.status_code}")

    def __del__(self):
        daemon = getattr(self, "daemon", None)
        if daemon is not None:
            stop([daemon])


app = FastAPI(title="jaxsmol on Ray Serve", docs_url=None, redoc_url=None)


@serve.deployment
@serve.ingress(app)
class Ingress:
    def __init__(self, replicas):
        self.replicas = replicas.options(stream=True)

    async def _relay(self, path: str, raw: bytes, authorization: str | None):
        answer = self.replicas.call.remote(make_call(path, raw, authorization))
        head = await answer.__anext__()

        async def rest():
            async for piece in answer:
                yield piece

        return StreamingResponse(rest(), status_code=head["status"], media_type=head["content_type"])

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._relay("/v1/completions", await request.body(), request.headers.get("authorization"))

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request):
        return await self._relay("/v1/chat/completions", await request.body(), request.headers.get("authorization"))

    @app.get("/v1/models")
    async def models(self, request: Request):
        return await self._relay("/v1/models", b"", request.headers.get("authorization"))

    @app.get("/health")
    async def health(self):
        return JSONResponse({"status": "ok"})


def build_app(config: dict):
    """The application: `replicas` (default 2) JaxsmolReplica copies behind the Ingress. `serve_args`:
    the `jaxsmol serve` options, a list or one string; `num_cpus`: Ray's CPUs per replica (default 1)."""
    serve_args = config.get("serve_args", [])
    serve_args = shlex.split(serve_args) if isinstance(serve_args, str) else list(serve_args)
    replicas = JaxsmolReplica.options(num_replicas=int(config.get("replicas", 2)),
                                      ray_actor_options={"num_cpus": float(config.get("num_cpus", 1))})
    return Ingress.bind(replicas.bind(serve_args))
