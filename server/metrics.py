"""Prometheus metrics, exposed through the standard client library (`prometheus_client`).

Server-side series are kept here, in a registry of each server's own (tests run several servers in one process);
engine series (queue depth, batch sizes, step times per stage, slots, the prompt-prefix cache) are read from
`engine.stats()` at scrape time and handed to the library as metric families.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from engine import EngineStats, FirstAudioTimes, LoopStats, StageStats

# The hand-written exposition this replaced never had `*_created` series; dashboards and alerts know the names it
# had, so the library is told not to add them (its documented switch; it reads this when it collects).
prometheus_client.disable_created_metrics()

# generate_latest writes the 0.0.4 text format whatever the library's newest negotiated format is.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# 1 ms steps to 30 ms: the targets are 10-20 ms, and the load generator compares the server's p50 with the
# client's to the ms (the 5 ms steps before kept every bound they had, so old queries still find theirs).
TTFA_BUCKETS_S = (*(i / 1000 for i in range(1, 31)), 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0,
                  5.0)
# A first-audio phase lasts from microseconds to a few ms: 0.25 ms steps to 5 ms, 1 ms steps to 20 ms, then coarser.
FIRST_AUDIO_PHASE_BUCKETS_S = (*(round(i * 0.00025, 5) for i in range(1, 21)), *(i / 1000 for i in range(6, 21)),
                               0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
# The phases of a context's server-side TTFA, in order: each runs from the point before to its own point (the
# first from the TTFA's start), so they sum to the TTFA. docs/benchmarks/README.md, "Where first audio goes".
FIRST_AUDIO_PHASES = (
    "server_in",  # the TTFA's start (HTTP: the request; WebSocket: the context's first text) -> its first text ids
    # handed to the engine (parsing, normalisation, tokenizing, the context's open)
    "engine_in",  # -> the engine has it (the hand-over: with the engine in its own process, the command's pickling,
    # the pipe and the engine process's wake-up; the scheduler's lock in both)
    "queue",  # -> the step of its prefill (the FIRST_AUDIO chain, by default) planned
    "behind",  # -> the device finished the work queued ahead of that step (the step in flight when it was planned)
    "launch",  # -> the device started it (the host's launch, where the device was idle before it)
    "prefill",  # -> its prefill ended on the device
    "code_predictor",  # -> its frame 0's Code Predictor ended on the device (three steps: with the host between)
    "codec",  # -> its first codec chunk ended on the device (three steps: with the host and other steps between)
    "collect",  # -> that chunk's audio collected on the engine thread
    "deliver",  # -> the event loop took it
    "encode",  # -> the first packets ready (trim + encode, with the hop to the encoder pool where it runs there)
    "send",  # -> handed to the socket (WebSocket) or to the ASGI send (HTTP)
)
# The engine's own histograms count per bucket of these bounds: one definition, the engine's.
ENGINE_STEP_BUCKETS_S = StageStats.BUCKETS_S
LOOP_IDLE_BUCKETS_S = LoopStats.BUCKETS_S


class _Series:
    """One library metric, called the way the server's doors call it: label values positionally
    (`errors.inc("ws", code)`), so the call sites do not change with the library."""

    library_type: type = prometheus_client.Counter

    def __init__(self, registry: prometheus_client.CollectorRegistry, name: str, help_: str,
                 labels: tuple[str, ...] = (), **kwargs):
        self.name, self.labelnames, self._registry = name, labels, registry
        self._metric = self.library_type(name, help_, labels, registry=registry, **kwargs)

    def _child(self, labels: tuple):
        return self._metric.labels(*labels) if self.labelnames else self._metric


class Counter(_Series):
    def inc(self, *labels, amount: float = 1.0) -> None:
        self._child(labels).inc(amount)

    def get(self, *labels) -> float:
        """The current value (for tests and logs; it walks the registry)."""
        value = self._registry.get_sample_value(self.name, dict(zip(self.labelnames, labels, strict=True)))
        return value or 0.0


class Gauge(Counter):
    library_type = prometheus_client.Gauge

    def set(self, *labels, value: float) -> None:
        self._child(labels).set(value)

    def dec(self, *labels, amount: float = 1.0) -> None:
        self._child(labels).dec(amount)


class Histogram(_Series):
    library_type = prometheus_client.Histogram

    def __init__(self, registry, name, help_, labels=(), buckets: Iterable[float] = TTFA_BUCKETS_S):
        super().__init__(registry, name, help_, labels, buckets=tuple(buckets))

    def observe(self, *labels, value: float) -> None:
        self._child(labels).observe(value)


def first_audio_phases(start: float, times: FirstAudioTimes, packets_at: float | None,
                       sent: float, text_handed_at: float | None = None) -> dict[str, float]:
    """A context's server-side TTFA (start -> sent, time.monotonic()) cut into FIRST_AUDIO_PHASES at the engine's
    points (`times`) and the first packets' readiness (`packets_at`), seconds; they sum to sent - start. The
    device's points come from CUDA events mapped to the host's clock (to within microseconds); each point is held
    between its neighbours, and a point not known (nothing queued ahead, a record without device times) adds a
    zero phase. When the first bytes sent carried no packet (a WAV header) the encode phase runs to the send. Without
    the time its text was handed to the engine (`text_handed_at`), server_in runs to the engine's arrival."""
    ready = sent if packets_at is None else min(packets_at, sent)
    received = times.collected if times.received is None else times.received
    device = (times.ahead_done, times.prefill_started, times.prefill_done, times.code_predictor_done,
              times.codec_done)
    handed = times.arrival if text_handed_at is None else min(max(text_handed_at, start), times.arrival)
    points = [start, handed, times.arrival, times.prefill_planned]
    for point in device:  # inside [planned, collected], in order
        points.append(points[-1] if point is None else min(max(point, points[-1]), times.collected))
    points += [times.collected, received, ready, sent]
    return {name: b - a for name, (a, b) in zip(FIRST_AUDIO_PHASES, itertools.pairwise(points), strict=True)}


def phases_text(phases: dict[str, float]) -> str:
    """The phases for a log line, ms with 2 decimals ("" without them)."""
    return "; first audio ms: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in phases.items()) if phases else ""


class _Scrape:
    """What one scrape exposes: the server's own registry, then the families known only at scrape time."""

    def __init__(self, registries: list[prometheus_client.CollectorRegistry], scrape_time: list[Metric]):
        self.registries, self.scrape_time = registries, scrape_time

    def collect(self) -> Iterator[Metric]:
        for registry in self.registries:
            yield from registry.collect()
        yield from self.scrape_time


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = prometheus_client.CollectorRegistry(auto_describe=False)
        self.ttfa = Histogram(r, "voicelane_ttfa_seconds", "Server-side time to first audio: a context's first text "
                              "(HTTP: the request) to its first audio handed to the socket", ("transport",))
        self.first_audio_phase = Histogram(r, "voicelane_first_audio_phase_seconds", "Server-side time to first "
                                           "audio, phase by phase (they sum to voicelane_ttfa_seconds): server_in, "
                                           "engine_in, queue, behind, launch, prefill, code_predictor, codec, collect, "
                                           "deliver, encode, send", ("transport", "phase"),
                                           buckets=FIRST_AUDIO_PHASE_BUCKETS_S)
        self.active_contexts = Gauge(r, "voicelane_active_contexts", "Contexts open now", ("transport",))
        self.sessions = Gauge(r, "voicelane_ws_sessions", "WebSocket sessions open now")
        self.contexts = Counter(r, "voicelane_contexts_total", "Contexts ended, by how", ("transport", "reason"))
        self.rejections = Counter(r, "voicelane_rejections_total", "Requests, sessions or contexts refused, by code",
                                  ("transport", "code"))
        self.errors = Counter(r, "voicelane_errors_total", "Error messages sent, by code", ("transport", "code"))
        self.underruns = Counter(r, "voicelane_client_underruns_total", "Playback underruns reported by clients "
                                 "(playback state 'underrun', counted once per stall)")
        self.playback_reports = Counter(r, "voicelane_client_playback_reports_total", "Playback reports from clients",
                                        ("state",))
        self.audio_seconds = Counter(r, "voicelane_audio_seconds_total", "Audio sent (listener timeline)",
                                     ("transport",))
        self.slow_readers = Counter(r, "voicelane_slow_reader_disconnects_total", "Sessions closed with 4009")
        # The library names a counter's family without `_total`, so `voicelane_ws_sessions_total` would collide
        # with the gauge `voicelane_ws_sessions` in one registry; both names predate the library and stay.
        self._sessions_total_registry = prometheus_client.CollectorRegistry(auto_describe=False)
        self.sessions_total = Counter(self._sessions_total_registry, "voicelane_ws_sessions_total",
                                      "WebSocket sessions, by how they closed", ("close_code",))

    def observe_first_audio(self, transport: str, start: float, sent: float, times: FirstAudioTimes | None,
                            packets_at: float | None, text_handed_at: float | None = None) -> dict[str, float]:
        """A context's first audio was handed to its socket at `sent`: its server-side TTFA and, with the engine's
        record of it (`times`), its phases (returned, for the request's log line; empty without a record)."""
        self.ttfa.observe(transport, value=sent - start)
        if times is None:
            return {}
        phases = first_audio_phases(start, times, packets_at, sent, text_handed_at)
        for phase, seconds in phases.items():
            self.first_audio_phase.observe(transport, phase, value=seconds)
        return phases

    def render(self, engine_stats: EngineStats | None, info: dict, readiness: dict | None) -> str:
        info_family = GaugeMetricFamily("voicelane_info", "The served model", labels=list(info))
        info_family.add_metric([str(v) for v in info.values()], 1)
        ready = GaugeMetricFamily("voicelane_ready", "1 when the server accepts work (/ready)",
                                  value=1 if readiness and readiness.get("ready") else 0)
        scrape_time = [info_family, ready] + (engine_families(engine_stats) if engine_stats is not None else [])
        return prometheus_client.generate_latest(_Scrape([self.registry, self._sessions_total_registry],
                                                               scrape_time)).decode()


def engine_families(s: EngineStats) -> list[Metric]:
    """The engine's series from one `Engine.stats()` snapshot."""
    out: list[Metric] = [
        GaugeMetricFamily("voicelane_engine_open_contexts", "Contexts open in the engine", s.open_contexts),
        GaugeMetricFamily("voicelane_engine_free_slots", "Free request slots (KV cache rows)", s.free_slots),
        GaugeMetricFamily("voicelane_engine_waiting_first_audio",
                          "Requests with text still waiting for their first audio", s.waiting_first_audio),
        GaugeMetricFamily("voicelane_engine_text_starved", "Requests waiting for more text", s.text_starved),
        GaugeMetricFamily("voicelane_engine_pacing", "1 while real-time streams may be held at light load "
                          "(--pace-buffer-ms; 0 when off, and from the start of a drain)", int(s.pacing)),
        GaugeMetricFamily("voicelane_engine_kv_cache_bytes", "KV cache memory", s.kv_cache_bytes),
        GaugeMetricFamily("voicelane_engine_max_slots", "Request slots (KV cache rows): configured, or sized from "
                          "the device's memory", s.max_slots),
    ]
    p = s.prefix_cache
    out += [
        CounterMetricFamily("voicelane_prefix_cache_hits_total", "Prefill rows whose prompt prefix was copied from "
                            "the prefix cache instead of computed", p.hits),
        CounterMetricFamily("voicelane_prefix_cache_misses_total", "Prefill rows that computed their prompt prefix "
                            "(it is then kept)", p.misses),
        CounterMetricFamily("voicelane_prefix_cache_evictions_total", "Prefix cache entries dropped to stay within "
                            "its bounds", p.evictions),
        CounterMetricFamily("voicelane_prefix_cache_invalidations_total", "Times the prefix cache was emptied "
                            "because the weights changed", p.invalidations),
        GaugeMetricFamily("voicelane_prefix_cache_entries", "Prompt prefixes cached now", p.entries),
        GaugeMetricFamily("voicelane_prefix_cache_bytes", "Device memory the cached prefixes hold", p.bytes),
    ]
    depth = GaugeMetricFamily("voicelane_engine_queue_depth", "Requests waiting at each stage now", labels=["stage"])
    for stage, waiting in sorted(s.queue_depth.items()):
        depth.add_metric([stage], waiting)
    stages = sorted(s.stages.items())
    batch = GaugeMetricFamily("voicelane_engine_batch_size", "Rows in the last step of each stage", labels=["stage"])
    rows = CounterMetricFamily("voicelane_engine_rows_total",
                               "Rows processed by each stage (rows/steps = mean batch size)", labels=["stage"])
    steps = HistogramMetricFamily("voicelane_engine_step_seconds", "Step time of each stage", labels=["stage"])
    for stage, v in stages:
        batch.add_metric([stage], v.last_batch)
        rows.add_metric([stage], v.rows)
        cumulative = _cumulative(ENGINE_STEP_BUCKETS_S, v.histogram)
        if cumulative is not None:
            steps.add_metric([stage], cumulative, sum_value=v.seconds)
    loop = s.loop
    idle = HistogramMetricFamily("voicelane_engine_device_idle_seconds", "Device idle between consecutive steps (the "
                                 "host had not queued the next one yet; CUDA, one lane)")
    cumulative = _cumulative(LOOP_IDLE_BUCKETS_S, loop.idle_histogram)
    if cumulative is not None:
        idle.add_metric([], cumulative, sum_value=loop.idle_s)
    return out + [depth, batch, rows, steps, idle,
                  CounterMetricFamily("voicelane_engine_iterations", "Steps the engine loop launched",
                                      loop.iterations),
                  CounterMetricFamily("voicelane_engine_host_seconds", "Engine thread time planning, launching and "
                                      "bookkeeping steps, without its waits", loop.host_s)]


def _cumulative(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, int]] | None:
    """Per-bucket counts -> Prometheus' cumulative (le, count) pairs; None for an engine with other buckets (none
    rather than a wrong one)."""
    if len(counts) != len(bounds):
        return None
    return [(floatToGoString(bound), total) for bound, total in zip(bounds, itertools.accumulate(counts), strict=True)]
