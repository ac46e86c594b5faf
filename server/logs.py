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

current_trace: contextvars.ContextVar[str | None] = contextvars.ContextVar("voicelane_trace_id", default=None)
log = logging.getLogger("voicelane.server")

FORMAT = "%(asctime)s %(levelname)-7s %(name)s %(trace)s%(message)s"
_SECRET = re.compile(r"((?:token|api_key|key)=|bearer[. ])[^&\s\"',]+", re.IGNORECASE)


def redact(text: str) -> str:
    """Hide credentials in a log message (uvicorn logs WebSocket paths with their query string)."""
    return _SECRET.sub(r"\1***", text)


class TraceFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        trace = getattr(record, "trace_id", None) or current_trace.get()
        record.trace_id = trace
        record.trace = f"[trace_id={trace}] " if trace else ""
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken log call must not break logging
            return True
        low = message.lower()
        if "token=" in low or "key=" in low or "bearer" in low:
            record.msg, record.args = redact(message), None
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
