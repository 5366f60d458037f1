"""The HTTP APIs as pure data and pure functions, with no model and no server in it: OpenAI's requests and
what is refused (protocol.py), structured-output fields (structured_request.py), OpenAI's responses and
server-sent events (responses.py), OpenAI's Responses API (openai_responses.py), Anthropic's Messages API
(anthropic.py), and the typed values the HTTP side and the model worker pass (events.py).
Imports: jaxsmol and cache for their plain types only; nothing from jaxsmol.cli.server."""
