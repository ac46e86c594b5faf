"""API keys and browser origins (docs/protocol.md 1 and 2).

Keys come from `--api-key` (repeatable), `--api-key-file` (one per line, `#` comments) and the environment
variable VOICELANE_API_KEYS (comma-separated). They are compared in constant time (HMAC-SHA256 digests compared
with hmac.compare_digest against every key, so neither a key's length nor its position leaks) and never logged.

Where a key may be given:
- `Authorization: Bearer <key>` (HTTP and WebSocket);
- WebSocket only, for browsers that cannot set headers: `?token=<key>` or the subprotocol `bearer.<key>` next to
  `voicelane.v1` (the server accepts `voicelane.v1` and never echoes the key).

Origins: a request without an `Origin` header (not a browser) passes. A browser origin passes when it is the
server's own (same scheme-less host:port as the Host header), is listed in `--allowed-origins`, or that list
holds "*". On a server without API keys, "the server's own" also needs the Host to be an IP address or localhost:
under DNS rebinding a hostile page's name resolves to this server, and its Origin then equals the Host it sends,
so only a Host that no rebinding can forge proves the page was loaded from this server.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

ENV_KEYS = "VOICELANE_API_KEYS"


def read_key_file(path: str | os.PathLike) -> list[str]:
    lines = (line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def keys_from_env(environ: Mapping[str, str] | None = None) -> list[str]:
    raw = (environ if environ is not None else os.environ).get(ENV_KEYS, "")
    return [k.strip() for k in raw.split(",") if k.strip()]


class KeyChecker:
    """Constant-time membership test of a presented key."""

    def __init__(self, keys: Iterable[str]):
        self._salt = secrets.token_bytes(32)
        self._digests = [self._digest(k) for k in keys if k]

    def _digest(self, key: str) -> bytes:
        return hmac.new(self._salt, key.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, presented: str | None) -> bool:
        if not self._digests:
            return True
        probe = self._digest(presented or "")
        ok = False
        for d in self._digests:
            ok |= hmac.compare_digest(probe, d)
        return ok and bool(presented)


def bearer_token(headers: Mapping[str, str]) -> str | None:
    value = headers.get("authorization")
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def query_token(query_string: bytes | str) -> str | None:
    qs = query_string.decode("latin-1") if isinstance(query_string, bytes) else query_string
    values = parse_qs(qs).get("token")
    return values[0] if values else None


def subprotocol_token(subprotocols: Iterable[str]) -> str | None:
    for p in subprotocols:
        if p.lower().startswith("bearer."):
            return p[len("bearer."):]
    return None


def _unforgeable_host(host: str) -> bool:
    """An IP literal or localhost, with or without a port: a name no DNS answer can point elsewhere."""
    host = host.strip().lower()
    if host.startswith("["):  # [v6]:port
        name = host[1:].partition("]")[0]
    else:
        name = host.rpartition(":")[0] if host.count(":") == 1 else host
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class OriginPolicy:
    def __init__(self, allowed: Iterable[str], check_host: bool = False):
        allowed = [a.strip().rstrip("/") for a in allowed if a.strip()]
        self.any = "*" in allowed
        self.allowed = {a.lower() for a in allowed if a != "*"}
        self.check_host = check_host  # no API keys: the same-origin rule alone would pass a rebound name

    def allows(self, origin: str | None, host: str | None) -> bool:
        if not origin:
            return True  # not a browser
        o = origin.strip().rstrip("/").lower()
        if self.any or o in self.allowed:
            return True
        if o == "null":
            return False
        netloc = urlsplit(o).netloc
        if not host or netloc != host.strip().lower():
            return False
        return not self.check_host or _unforgeable_host(host)

    def cors_origins(self) -> list[str]:
        return ["*"] if self.any else sorted(self.allowed)
