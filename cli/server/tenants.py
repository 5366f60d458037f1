"""API keys and cache namespaces for `jaxsmol serve --api-key KEY` / `--api-keys FILE`.

With keys, every request needs `Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY` (else
401), and each key's prompts live in its own cache namespace, so `cached_tokens` never tells one
tenant about another's prompts; admin routes (cache flush, metrics) need an admin key (else 403).
Without keys, every request is allowed and shares the default namespace (the daemon listens on
loopback by default).

The keys file: one key a line, `KEY [NAMESPACE] [admin]`; `#` starts a comment. Keys naming the same
NAMESPACE share a cache namespace; `-` or no NAMESPACE gives the key a namespace of its own. Keys given
with --api-key are the operator's: admin keys, each with its own namespace.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from jaxsmol.cli.api.protocol import ProtocolError
from jaxsmol.errors import JaxsmolError


@dataclasses.dataclass(frozen=True)
class Tenant:
    namespace: str | None  # None: the default namespace (no keys configured)
    admin: bool


OPEN = Tenant(namespace=None, admin=True)


def _digest(key: str) -> str:
    # keys are looked up (and namespaces derived) by digest: no key in memory tables, salts or disk files
    return hashlib.sha256(key.encode()).hexdigest()


def parse_keys_file(text: str, source: str = "keys file") -> dict[str, Tenant]:
    """The keys file's text -> {sha256(key): Tenant}; a bad line is a JaxsmolError naming it."""
    out: dict[str, Tenant] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        key, rest = words[0], words[1:]
        admin = bool(rest) and rest[-1] == "admin"
        if admin:
            rest = rest[:-1]
        if len(rest) > 1:
            raise JaxsmolError(f"{source} line {n}: expected 'KEY [NAMESPACE] [admin]', got {len(words)} words")
        if _digest(key) in out:
            raise JaxsmolError(f"{source} line {n}: a key is listed twice")
        namespace = rest[0] if rest and rest[0] != "-" else None
        out[_digest(key)] = Tenant(namespace=f"ns:{namespace}" if namespace else f"key:{_digest(key)[:24]}",
                                   admin=admin)
    return out


class Tenants:
    """Who may call what, and under which cache namespace."""

    def __init__(self, keys: dict[str, Tenant] | None = None):
        self.keys = keys or {}

    @classmethod
    def from_options(cls, api_keys=(), keys_file: str | None = None) -> Tenants:
        keys = {}
        if keys_file is not None:
            try:
                text = Path(keys_file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise JaxsmolError(f"cannot read the API keys file {keys_file}: {e}") from None
            keys = parse_keys_file(text, keys_file)
        for key in api_keys or ():
            if not key.strip() or key != key.strip():
                raise JaxsmolError("--api-key: a key is a non-empty word without spaces")
            keys[_digest(key)] = Tenant(namespace=f"key:{_digest(key)[:24]}", admin=True)
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def authenticate(self, authorization: str | None, admin: bool = False, api_key: str | None = None) -> Tenant:
        """The caller of a request with this Authorization header, or without one this x-api-key header
        (Anthropic's); ProtocolError 401 / 403 otherwise."""
        if not self.enabled:
            return OPEN
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else ""
        key = key or (api_key or "").strip()
        tenant = self.keys.get(_digest(key)) if key else None
        if tenant is None:
            raise ProtocolError("a valid API key is needed: Authorization: Bearer KEY, or x-api-key: KEY",
                                status=401, type_="authentication_error")
        if admin and not tenant.admin:
            raise ProtocolError("this route needs an admin API key", status=403, type_="permission_error")
        return tenant


def cache_salt(tenant: Tenant, salt: str | None) -> str | None:
    """The salt handed to the prefix cache: the tenant's namespace, then the request's cache_salt."""
    if tenant.namespace is None:
        return salt
    return tenant.namespace + "\x00" + (salt or "")
