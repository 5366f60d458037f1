"""`jaxsmol serve`, the daemon: the HTTP app (serve.py), the one request driver that runs a job end to end
(completions.py: OpenAI's completions and chat), the routes driven by it (messages.py: Anthropic's Messages
API; responses_route.py and response_store.py: OpenAI's Responses API and its stored responses;
cache_routes.py: pins and inspection; prompt_scores.py: prompt log-probabilities), the model worker thread
that drives the scheduler (worker.py), API keys and cache namespaces (tenants.py), HTTP limits and
timeouts (limits.py), the access log (access_log.py), Prometheus metrics (metrics.py), the memory account
(memory.py), the warm-up before readiness (warmup.py) and what a router in front of several daemons reads
of one (replica.py).
Imports: cli.api, cli.common, cache, jaxsmol."""
