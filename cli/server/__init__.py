"""`jaxsmol serve`, the daemon: the HTTP app (serve.py), running a completion request end to end
(completions.py), the model worker thread that drives the scheduler (worker.py), API keys and cache
namespaces (tenants.py), Prometheus metrics (metrics.py), the memory account (memory.py), the warm-up
before readiness (warmup.py) and what a router in front of several daemons reads of one (replica.py).
Imports: cli.api, cli.common, cache, jaxsmol."""
