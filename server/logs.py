"""Logging with trace ids: every log line about a context carries its `trace_id` (docs/protocol.md 1.2).

A context's tasks set `current_trace` (a contextvar); `TraceFilter` copies it onto each record, so any log call
made while serving that context - ours or a library's - is tagged. `context_logger(trace_id)` gives a
LoggerAdapter for lines written elsewhere (the receive task handles many contexts).
"""

from __future__ import annotations

import contextvars
import logging
import re
import sys
from urllib.parse import unquote_plus

current_trace: contextvars.ContextVar[str | None] = contextvars.ContextVar("voicelane_trace_id", default=None)
log = logging.getLogger("voicelane.server")

FORMAT = "%(asctime)s %(levelname)-7s %(name)s %(trace)s%(message)s"
_BEARER = re.compile(r"(bearer[. ])[^&\s\"',]+", re.IGNORECASE)
# name=value at the start, after whitespace or a query separator; the name is judged once decoded, since the
# server decodes it before reading the key (?%74oken=<key> is ?token=<key>)
_PARAM = re.compile(r"(?<![^?&;\s])([^=&;\s\"'#]+)=([^&;\s\"'#]*)")


def _secret_name(raw: str) -> bool:
    name = raw
    for _ in range(4):  # %2574oken decodes to %74oken, then to token
        decoded = unquote_plus(name, errors="replace")
        if decoded == name:
            break
        name = decoded
    name = name.strip().lower().replace("-", "_")
    return "token" in name or "key" in name or name in ("auth", "authorization", "password", "secret")


def redact(text: str) -> str:
    """Hide credentials in a log message (uvicorn logs WebSocket paths with their query string): the value of
    every parameter whose name, however spelled or percent-encoded, is a token or a key, and bearer tokens."""
    text = _PARAM.sub(lambda m: f"{m.group(1)}=***" if _secret_name(m.group(1)) else m.group(0), text)
    return _BEARER.sub(r"\1***", text)


class TraceFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        trace = getattr(record, "trace_id", None) or current_trace.get()
        record.trace_id = trace
        record.trace = f"[trace_id={trace}] " if trace else ""
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken log call must not break logging
            return True
        if "=" in message or "bearer" in message.lower():
            redacted = redact(message)
            if redacted != message:
                record.msg, record.args = redacted, None
        return True


class _Adapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.setdefault("extra", {})["trace_id"] = self.extra["trace_id"]
        return msg, kwargs


def context_logger(trace_id: str, name: str = "voicelane.context") -> logging.LoggerAdapter:
    return _Adapter(logging.getLogger(name), {"trace_id": trace_id})


def setup_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(TraceFilter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
    # uvicorn's access log prints request paths with their query string (?token=...): it stays off; the server
    # writes its own request lines without query strings.
    logging.getLogger("uvicorn.access").disabled = True
