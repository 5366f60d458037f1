"""The commands: `jaxsmol` (main.py: generate, tokenize, cacheprobe, score, serve, cluster, bench,
import-gguf, info), `aitest` (aitest.py, the course exercise's client), a small HTTP client (client.py),
shared option plumbing (common.py; serve's options, shared with cluster: serve_options.py), tables
(tables.py) and `jaxsmol info` (info.py). Replicas behind a router: `jaxsmol cluster` (cluster.py) starts
daemons and sglang-router as processes (replicas.py); ray_serve.py is the Ray Serve application.
Subpackages: api/ (the OpenAI protocol, pure), server/ (the daemon), bench/ (`jaxsmol bench`). Imports
flow cli -> cache -> jaxsmol."""
