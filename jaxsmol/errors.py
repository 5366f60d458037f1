"""User-facing errors: one clear line, no traceback (the CLI prints `error: <message>` and exits 2)."""


class JaxsmolError(ValueError):
    """Bad input or a bad model directory; the message names the problem."""
