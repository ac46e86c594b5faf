"""The wire contract of docs/protocol.md, validated at the edge: the one error table (codes -> HTTP status, WebSocket
fatal / retryable / close code), the JSON field readers, and the client message envelope. Every bad input becomes a
ProtocolError with its code. (What a context is opened with - formats, sampling, voices, defaults - is in
server/options.py.)

Nothing here touches sockets, the engine or audio: parsing is pure, so the gateway and the HTTP front door share it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

PROTOCOL_VERSION = "voicelane/1"
SUBPROTOCOL = "voicelane.v1"
MAX_ID_CHARS = 128

# ------------------------------------------------------------------------------------------------- the error table


@dataclass(frozen=True)
class ErrorKind:
    http_status: int
    http_type: str  # OpenAI-style error "type"
    retryable: bool = False
    fatal: bool = False  # WebSocket: the session ends (close_code)
    close_code: int | None = None


ERRORS: dict[str, ErrorKind] = {
    # per message / per context (never fatal on the WebSocket)
    "invalid_json": ErrorKind(400, "invalid_request_error"),
    "unknown_type": ErrorKind(400, "invalid_request_error"),
    "invalid_field": ErrorKind(400, "invalid_request_error"),
    "unknown_context": ErrorKind(404, "invalid_request_error"),
    "context_closed": ErrorKind(409, "invalid_request_error"),
    "duplicate_context": ErrorKind(409, "invalid_request_error"),
    "context_limit": ErrorKind(429, "rate_limit_error"),
    "rate_limited": ErrorKind(429, "rate_limit_error", retryable=True),  # HTTP only (--rate-limit-rps)
    "text_too_long": ErrorKind(413, "invalid_request_error"),
    "unsupported_format": ErrorKind(400, "invalid_request_error"),
    "unknown_voice": ErrorKind(400, "invalid_request_error"),
    "unknown_language": ErrorKind(400, "invalid_request_error"),
    "overloaded": ErrorKind(503, "overloaded_error", retryable=True),
    "synthesis_failed": ErrorKind(500, "server_error"),
    "internal": ErrorKind(500, "server_error"),
    # session level (fatal on the WebSocket; the close code says why)
    "unauthorized": ErrorKind(401, "authentication_error", fatal=True, close_code=4001),
    "origin_not_allowed": ErrorKind(403, "permission_error", fatal=True, close_code=4003),
    "idle_timeout": ErrorKind(408, "invalid_request_error", fatal=True, close_code=4008),
    "request_timeout": ErrorKind(408, "invalid_request_error"),  # HTTP only: the body came too slowly
    "slow_reader": ErrorKind(400, "invalid_request_error", fatal=True, close_code=4009),
    "too_many_sessions": ErrorKind(429, "rate_limit_error", retryable=True, fatal=True, close_code=4029),
    "not_ready": ErrorKind(503, "overloaded_error", retryable=True, fatal=True, close_code=1013),
    "not_found": ErrorKind(404, "invalid_request_error"),
}
WARNINGS = ("context_not_active",)

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # server draining
CLOSE_INTERNAL = 1011


class ProtocolError(Exception):
    """A typed failure. `code` is a key of ERRORS; `param` names the offending field."""

    def __init__(self, code: str, message: str, param: str | None = None, *, context_id: str | None = None):
        if code not in ERRORS:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(message)
        self.code, self.message, self.param, self.context_id = code, message, param, context_id


def as_protocol_error(exc: Exception) -> ProtocolError:
    """A ProtocolError as it is; an engine error (its `code`, message and `param`) as one, `internal` for a code the
    table lacks."""
    if isinstance(exc, ProtocolError):
        return exc
    code = getattr(exc, "code", None)
    return ProtocolError(code if code in ERRORS else "internal", str(exc), getattr(exc, "param", None))


def ws_error(code: str, message: str, *, context_id: str | None = None, event_id: Any = None,
             param: str | None = None, fatal: bool | None = None) -> dict:
    kind = ERRORS[code]
    msg = {"type": "error", "code": code, "message": message, "fatal": kind.fatal if fatal is None else fatal,
           "retryable": kind.retryable}
    return with_ids(msg, context_id=context_id, event_id=event_id, param=param)


def ws_warning(code: str, message: str, *, context_id: str | None = None, event_id: Any = None) -> dict:
    assert code in WARNINGS
    return with_ids({"type": "warning", "code": code, "message": message}, context_id=context_id, event_id=event_id)


def with_ids(msg: dict, **ids: Any) -> dict:
    """`msg` with the given ids (context_id, event_id, param) that are not None."""
    msg.update((k, v) for k, v in ids.items() if v is not None)
    return msg


def http_error_body(code: str, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERRORS[code].http_type, "param": param, "code": code}}


# ------------------------------------------------------------------------------------------------ JSON and fields


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(text: str | bytes) -> dict:
    """A JSON object, or ProtocolError(invalid_json) (also for NaN/Infinity, absurd nesting, huge numbers)."""
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ProtocolError("invalid_json", "JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError("invalid_json", f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("invalid_json", f"expected a JSON object, got {type(obj).__name__}")
    return obj


def type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), "number" if isinstance(v, int | float) else type(v).__name__)


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def is_unicode(s: str) -> bool:
    """False for a string holding a lone surrogate (JSON lets `\\ud800` through; UTF-8 cannot carry it)."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def lone_surrogate_path(obj: Any) -> str | None:
    """Where the first lone surrogate of a parsed JSON message sits: a field path ("sampling.top_k", "a[2]"), the
    path of the object whose key holds it, or None. The path only names keys that are valid Unicode themselves,
    so it can be echoed safely."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not is_unicode(v):
                return path or "(message)"
        elif isinstance(v, dict):
            for k, item in v.items():
                if not is_unicode(k):
                    return path or "(message)"
                stack.append((f"{path}.{k[:64]}" if path else k[:64], item))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
    return None


def check_unicode(obj: Any) -> None:
    """ProtocolError(invalid_field) naming the field when any string or key of `obj` holds a lone surrogate:
    every string the server may echo is checked where it enters."""
    path = lone_surrogate_path(obj)
    if path is not None:
        raise ProtocolError("invalid_field", f"'{path}' has a lone surrogate (not valid Unicode)", path)


def is_valid_id(v: Any) -> bool:
    """A protocol id that may be echoed: a non-empty string of at most 128 code points, valid Unicode."""
    return isinstance(v, str) and 0 < len(v) <= MAX_ID_CHARS and is_unicode(v)


def _field(obj: dict, name: str, param: str | None, required: bool, ok, what: str) -> tuple[str, Any]:
    """(the name errors give the field, its value): None when absent or null (invalid_field when `required`),
    else a value `ok` accepts (invalid_field: it must be `what`). Lone surrogates are not looked for here: each
    door runs check_unicode over the whole message where it enters."""
    param = param or name
    v = obj.get(name)
    if v is None:
        if required:
            raise ProtocolError("invalid_field", f"'{param}' is required", param)
    elif not ok(v):
        raise ProtocolError("invalid_field", f"'{param}' must be {what}, got {type_name(v)}", param)
    return param, v


def get_id(obj: dict, name: str, *, required: bool = True) -> str | None:
    """A protocol id: a non-empty string of at most 128 code points."""
    _, v = _field(obj, name, None, required, lambda v: isinstance(v, str) and v, "a non-empty string")
    if v is not None and len(v) > MAX_ID_CHARS:
        raise ProtocolError("invalid_field", f"'{name}' is longer than {MAX_ID_CHARS} characters", name)
    return v


def get_flush_id(obj: dict) -> str | int | None:
    """`flush_id`: a string id or an integer, echoed as given."""
    v = obj.get("flush_id")
    if v is None or _is_int(v):
        return v
    return get_id(obj, "flush_id")


def get_str(obj: dict, name: str, *, required: bool = False, choices: tuple[str, ...] | None = None,
            max_chars: int | None = None, param: str | None = None) -> str | None:
    param, v = _field(obj, name, param, required, lambda v: isinstance(v, str), "a string")
    if v is None:
        return None
    if choices is not None and v not in choices:
        raise ProtocolError("invalid_field", f"'{param}' is {v!r}; one of {', '.join(choices)}", param)
    if max_chars is not None and len(v) > max_chars:
        raise ProtocolError("invalid_field", f"'{param}' is longer than {max_chars} characters", param)
    return v


def _at_least(v: float, minimum: float | None, param: str) -> None:
    if minimum is not None and v < minimum:
        raise ProtocolError("invalid_field", f"'{param}' must be >= {minimum}, got {v}", param)


def get_number(obj: dict, name: str, *, required: bool = False, minimum: float | None = None,
               param: str | None = None) -> float | None:
    param, v = _field(obj, name, param, required, is_number, "a finite number")
    if v is None:
        return None
    _at_least(v, minimum, param)
    return float(v)


def get_int(obj: dict, name: str, *, minimum: int | None = None, maximum: int | None = None,
            param: str | None = None) -> int | None:
    """An integer; a float with an integral value (3.0) is taken as one."""
    param, v = _field(obj, name, param, False, lambda v: _is_int(v) or (isinstance(v, float) and v.is_integer()),
                      "an integer")
    if v is None:
        return None
    v = int(v)
    _at_least(v, minimum, param)
    if maximum is not None and v > maximum:
        raise ProtocolError("invalid_field", f"'{param}' must be <= {maximum}, got {v}", param)
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def get_bool(obj: dict, name: str, *, param: str | None = None) -> bool | None:
    return _field(obj, name, param, False, lambda v: isinstance(v, bool), "true or false")[1]


def get_object(obj: dict, name: str, *, param: str | None = None) -> dict | None:
    return _field(obj, name, param, False, lambda v: isinstance(v, dict), "an object")[1]


# ------------------------------------------------------------------------------------------------ client messages

CLIENT_TYPES = ("session.update", "context.create", "text", "flush", "context.close", "context.cancel", "cancel_all",
                "playback", "ping", "session.close")
PLAYBACK_STATES = ("buffering", "playing", "underrun", "finished")


def parse_envelope(obj: dict) -> tuple[str, str | None]:
    """`type` and `event_id` of any client message (the rest is read by the handler of that type)."""
    event_id = get_id(obj, "event_id", required=False)
    t = get_str(obj, "type", required=True)
    if t not in CLIENT_TYPES:
        raise ProtocolError("unknown_type", f"unknown message type {t[:64]!r}; one of {', '.join(CLIENT_TYPES)}",
                            "type")
    return t, event_id


def parse_played_map(v: Any) -> dict[str, float]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ProtocolError("invalid_field", f"'played' must be an object of context_id: ms, got {type_name(v)}",
                            "played")
    out = {}
    for k, ms in v.items():
        if not is_valid_id(k):
            raise ProtocolError("invalid_field", f"'played' keys must be context ids (1..{MAX_ID_CHARS} characters, "
                                f"valid Unicode); got {k[:64]!r}", "played")
        if not is_number(ms) or ms < 0:
            raise ProtocolError("invalid_field", f"'played.{k[:64]}' must be a number >= 0", "played")
        out[k] = float(ms)
    return out
