"""The OpenAI API as pure data and pure functions, with no model and no server in it: requests and what
is refused (protocol.py), structured-output fields (structured_request.py), responses and server-sent
events (responses.py), and the typed values the HTTP side and the model worker pass (events.py).
Imports: jaxsmol and cache for their plain types only; nothing from jaxsmol.cli.server."""
