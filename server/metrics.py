"""Prometheus metrics (text exposition format 0.0.4), without a client library.

Server-side series are kept here; engine series (queue depth, batch sizes, step times per stage, slots) are read
from `engine.stats()` at scrape time.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFA_BUCKETS_S = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                  2.0, 5.0)
ENGINE_STEP_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, math.inf)  # StageStats.BUCKETS_S


def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple, extra: str = "") -> str:
    parts = [f'{n}="{_esc(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if isinstance(v, int) or float(v).is_integer():
        return str(int(v))
    return repr(float(v))


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help_: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.labelnames = name, help_, labels
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name, help_, labels=()):
        super().__init__(name, help_, labels)
        self.values: dict[tuple, float] = {}

    def inc(self, *labels, amount: float = 1.0) -> None:
        with self._lock:
            self.values[labels] = self.values.get(labels, 0.0) + amount

    def get(self, *labels) -> float:
        return self.values.get(labels, 0.0)

    def render(self) -> list[str]:
        out = self.header()
        for lv, v in sorted(self.values.items()):
            out.append(f"{self.name}{_labels(self.labelnames, lv)} {_num(v)}")
        return out


class Gauge(Counter):
    kind = "gauge"

    def set(self, *labels, value: float) -> None:
        with self._lock:
            self.values[labels] = value

    def dec(self, *labels, amount: float = 1.0) -> None:
        self.inc(*labels, amount=-amount)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name, help_, labels=(), buckets: Iterable[float] = TTFA_BUCKETS_S):
        super().__init__(name, help_, labels)
        self.buckets = tuple(b for b in buckets if b != math.inf) + (math.inf,)
        self.series: dict[tuple, list] = {}  # labels -> [counts per bucket, sum, count]

    def observe(self, *labels, value: float) -> None:
        with self._lock:
            s = self.series.setdefault(labels, [[0] * len(self.buckets), 0.0, 0])
            for i, b in enumerate(self.buckets):
                if value <= b:
                    s[0][i] += 1
                    break
            s[1] += value
            s[2] += 1

    def render(self) -> list[str]:
        out = self.header()
        for lv, (counts, total, n) in sorted(self.series.items()):
            out += render_histogram(self.name, self.labelnames, lv, self.buckets, counts, total, n)
        return out


def render_histogram(name, labelnames, labelvalues, buckets, counts, total, n) -> list[str]:
    out, cum = [], 0
    for b, c in zip(buckets, counts, strict=True):
        cum += c
        le = 'le="' + _num(b) + '"'
        out.append(f"{name}_bucket{_labels(labelnames, labelvalues, le)} {cum}")
    out.append(f"{name}_sum{_labels(labelnames, labelvalues)} {_num(total)}")
    out.append(f"{name}_count{_labels(labelnames, labelvalues)} {n}")
    return out


class ServerMetrics:
    def __init__(self) -> None:
        self.ttfa = Histogram("voicelane_ttfa_seconds", "Server-side time to first audio: a context's first text "
                              "(HTTP: the request) to its first audio handed to the socket", ("transport",))
        self.active_contexts = Gauge("voicelane_active_contexts", "Contexts open now", ("transport",))
        self.sessions = Gauge("voicelane_ws_sessions", "WebSocket sessions open now")
        self.contexts = Counter("voicelane_contexts_total", "Contexts ended, by how", ("transport", "reason"))
        self.rejections = Counter("voicelane_rejections_total", "Requests, sessions or contexts refused, by code",
                                  ("transport", "code"))
        self.errors = Counter("voicelane_errors_total", "Error messages sent, by code", ("transport", "code"))
        self.underruns = Counter("voicelane_client_underruns_total", "Playback underruns reported by clients "
                                 "(playback state 'underrun', counted once per stall)")
        self.playback_reports = Counter("voicelane_client_playback_reports_total", "Playback reports from clients",
                                        ("state",))
        self.audio_seconds = Counter("voicelane_audio_seconds_total", "Audio sent (listener timeline)",
                                     ("transport",))
        self.slow_readers = Counter("voicelane_slow_reader_disconnects_total", "Sessions closed with 4009")
        self.sessions_total = Counter("voicelane_ws_sessions_total", "WebSocket sessions, by how they closed",
                                      ("close_code",))
        self._own = [self.ttfa, self.active_contexts, self.sessions, self.contexts, self.rejections, self.errors,
                     self.underruns, self.playback_reports, self.audio_seconds, self.slow_readers,
                     self.sessions_total]

    def render(self, engine_stats: dict | None, info: dict, readiness: dict | None) -> str:
        lines: list[str] = []
        for m in self._own:
            lines += m.render()
        lines += ["# HELP voicelane_info The served model", "# TYPE voicelane_info gauge",
                  f"voicelane_info{_labels(tuple(info), tuple(info.values()))} 1"]
        lines += ["# HELP voicelane_ready 1 when the server accepts work (/ready)", "# TYPE voicelane_ready gauge",
                  f"voicelane_ready {1 if readiness and readiness.get('ready') else 0}"]
        if engine_stats is not None:
            lines += render_engine(engine_stats)
        return "\n".join(lines) + "\n"


def render_engine(s: dict) -> list[str]:
    out: list[str] = []

    def gauge(name, help_, value):
        out.extend([f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {_num(value)}"])

    gauge("voicelane_engine_open_contexts", "Contexts open in the engine", s.get("open_contexts", 0))
    gauge("voicelane_engine_free_slots", "Free request slots (KV cache rows)", s.get("free_slots", 0))
    gauge("voicelane_engine_waiting_first_audio", "Requests with text still waiting for their first audio",
          s.get("waiting_first_audio", 0))
    gauge("voicelane_engine_text_starved", "Requests waiting for more text", s.get("text_starved", 0))
    gauge("voicelane_engine_kv_cache_bytes", "KV cache memory", s.get("kv_cache_bytes", 0))
    depth = s.get("queue_depth", {})
    out += ["# HELP voicelane_engine_queue_depth Requests waiting at each stage now",
            "# TYPE voicelane_engine_queue_depth gauge"]
    out += [f'voicelane_engine_queue_depth{{stage="{k}"}} {v}' for k, v in sorted(depth.items())]
    stages = s.get("stages", {})
    out += ["# HELP voicelane_engine_batch_size Rows in the last step of each stage",
            "# TYPE voicelane_engine_batch_size gauge"]
    out += [f'voicelane_engine_batch_size{{stage="{k}"}} {v["last_batch"]}' for k, v in sorted(stages.items())]
    out += ["# HELP voicelane_engine_rows_total Rows processed by each stage (rows/steps = mean batch size)",
            "# TYPE voicelane_engine_rows_total counter"]
    out += [f'voicelane_engine_rows_total{{stage="{k}"}} {v["rows"]}' for k, v in sorted(stages.items())]
    out += ["# HELP voicelane_engine_step_seconds Step time of each stage", "# TYPE voicelane_engine_step_seconds "
            "histogram"]
    for k, v in sorted(stages.items()):
        counts = list(v["histogram"])
        buckets = ENGINE_STEP_BUCKETS_S if len(counts) == len(ENGINE_STEP_BUCKETS_S) else None
        if buckets is None:
            continue
        out += render_histogram("voicelane_engine_step_seconds", ("stage",), (k,), buckets, counts, v["seconds"],
                                v["steps"])
    return out
