"""The commands: `jaxsmol` (main.py: generate, tokenize, cacheprobe, score, serve, bench, import-gguf,
info), `aitest` (aitest.py, the course exercise's client), a small HTTP client (client.py), shared option
plumbing (common.py), tables (tables.py) and `jaxsmol info` (info.py). Subpackages: api/ (the OpenAI
protocol, pure), server/ (the daemon), bench/ (`jaxsmol bench`). Imports flow cli -> cache -> jaxsmol."""
