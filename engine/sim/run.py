"""One simulated run: the real Scheduler and EngineCore, a simulated device, simulated clients, and the numbers.

Each client is the benchmark's listener (../shared/BENCHMARK.md 1): leading silence is dropped (the server's
trimmer), playback starts at the first audible packet with no pre-buffer and runs at 1x, and a packet that
arrives after it should start playing is an underrun (the player stalls until it arrives). TTFA here is dispatch
to the arrival of the first audible packet at the engine's output (no network, no encoder); the server's trimmer
keeps up to 20 ms of pre-roll before the onset. Refused requests enter the percentiles as +inf, as the
benchmark's do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from engine.config import EngineConfig, SchedulerConfig
from engine.core import EngineCore
from engine.model.config import ModelConfig
from engine.model.presets import model_config
from engine.model.prompt import resolve_voice
from engine.model.sampling_params import SamplingParams
from engine.prefix_cache import PrefixLRU
from engine.request import FRAME_S
from engine.scheduler import AdmissionRefused, Scheduler
from engine.sim.device import Events, SimClock, SimRunner
from engine.sim.profile import StageProfile
from engine.sim.workload import Arrival
from engine.trace import Timeline
from engine.types import AudioChunk, ContextDone, EngineEvent, Stage

SAMPLE_RATE = 24000


@dataclass
class Listener:
    """One client's view of its stream."""

    arrival: Arrival
    cid: int | None = None
    refused: str | None = None
    first_packet_at: float | None = None
    first_audible_at: float | None = None
    play_end: float = 0.0  # when the audio received so far finishes playing (stalls included)
    received_s: float = 0.0  # audio queued for playback (after the dropped leading silence)
    dropped_s: float = 0.0  # leading silence the server's trimmer dropped
    underruns: int = 0
    stall_s: float = 0.0
    done_at: float | None = None

    def packet(self, t: float, e: AudioChunk, silent_frames: int) -> None:
        seconds = len(e.pcm) / SAMPLE_RATE
        if self.first_packet_at is None:
            self.first_packet_at = t
        if self.first_audible_at is None:
            if e.first_frame + e.codes.shape[0] <= silent_frames:
                self.dropped_s += seconds  # all silence: the trimmer drops it
                return
            self.first_audible_at = self.play_end = t
        elif t > self.play_end:
            self.underruns += 1
            self.stall_s += t - self.play_end
            self.play_end = t
        self.play_end += seconds
        self.received_s += seconds

    def report(self, now: float) -> tuple[float, str, float]:
        """(played ms on the context timeline, player state, buffered ms) for a playback ack."""
        buffered = max(0.0, self.play_end - now)
        state = "playing" if buffered > 0 else "underrun"
        return (self.dropped_s + self.received_s - buffered) * 1e3, state, buffered * 1e3

    @property
    def ttfa_s(self) -> float:
        return math.inf if self.first_audible_at is None else self.first_audible_at - self.arrival.at


@dataclass
class SimOptions:
    host_step_s: float = 0.0003  # host time of one engine iteration (plan, launch, bookkeeping)
    lane_slowdown: float = 1.0  # two lanes: a step overlapping the other lane's work takes this much longer
    word_interval_s: float = 0.010  # streamed mode: seconds between words (W2)
    ack_interval_s: float = 0.0  # playback acks every this many seconds once playing (0: none, as HTTP clients)
    frames_per_word: int = 5  # the benchmark's length mode
    drain_s: float = 60.0  # after the last arrival, how long the run may continue to finish streams
    # the engine's prompt-prefix cache (EngineConfig's bounds; 0: off, every prefill runs its whole prompt)
    prefix_cache_entries: int = EngineConfig.prefix_cache_entries
    prefix_cache_mib: float = EngineConfig.prefix_cache_mib
    # the consumer reports each segment's audible onset (the server's trimmer does); False: the first-audio class
    # ends at the first chunk, silent or not (the policy before issue 13, to compare)
    reports_onset: bool = True


@dataclass
class SimReport:
    listeners: list[Listener]
    steps: list[tuple[Stage, int, int, float, float]]
    busy_s: float
    span_s: float
    options: SimOptions
    extra: dict = field(default_factory=dict)

    def ttfa_ms(self) -> np.ndarray:
        return np.array([x.ttfa_s * 1e3 for x in self.listeners])

    def summary(self) -> dict:
        from bench.metrics import percentiles

        ttfa = self.ttfa_ms()
        served = [x for x in self.listeners if x.refused is None]
        stages = {}
        for stage in Stage:
            mine = [(rows, s) for st, rows, _, _, s in self.steps if st == stage]
            if mine:
                ms = np.array([s for _, s in mine]) * 1e3
                stages[stage.value] = {"steps": len(mine), "mean_rows": round(float(np.mean([r for r, _ in mine])), 1),
                                       "mean_ms": round(float(ms.mean()), 2),
                                       "p95_ms": round(float(np.percentile(ms, 95)), 2)}
        return {"requests": len(self.listeners), "refused": len(self.listeners) - len(served),
                "ttfa_ms": {k: round(v, 1) for k, v in percentiles(ttfa).items()},
                "underrun_requests": sum(1 for x in served if x.underruns),
                "stall_ms": round(sum(x.stall_s for x in served) * 1e3, 1),
                "unfinished": sum(1 for x in served if x.done_at is None),
                "gpu_busy": round(self.busy_s / self.span_s, 3) if self.span_s else 0.0,
                "stages": stages, **self.extra}


class Simulation:
    """Drive the real scheduler with `arrivals` on a device whose step times come from `profile`."""

    def __init__(self, cfg: SchedulerConfig, profile: StageProfile, arrivals: list[Arrival],
                 options: SimOptions | None = None, model: str = "1.7b"):
        self.options = options or SimOptions()
        cfg = _bench_length(cfg, self.options.frames_per_word)
        self.model_cfg = ModelConfig.from_dict(model_config(model))
        self.voice = resolve_voice(self.model_cfg, "ryan", "english")
        self.clock = SimClock()
        self.events = Events(self.clock)
        self.scheduler = Scheduler(cfg, self.model_cfg, None)
        self.listeners = [Listener(a) for a in arrivals]
        self.by_cid: dict[int, Listener] = {}
        o, stack = self.options, self.model_cfg.talker.stack
        self.prefix_cache = PrefixLRU(o.prefix_cache_entries, int(o.prefix_cache_mib * 2**20))
        position_bytes = 2 * stack.num_layers * stack.num_kv_heads * stack.head_dim * 2  # bf16 keys and values
        self.runner = SimRunner(profile, self.clock, self.events, o.host_step_s,
                                lambda cid: self.by_cid[cid].arrival.silent_frames, max(cfg.chunk_ramp),
                                self.prefix_cache, position_bytes)
        self.runner.lane_slowdown = o.lane_slowdown
        self._called = False  # a client's call reached the scheduler during the engine's current iteration
        self.core = EngineCore(self.scheduler, self.runner, self._deliver, Timeline(1), self.clock,
                               plan_lead_s=cfg.plan_lead_s, sleep=self._sleep)
        for listener in self.listeners:
            self.events.at(listener.arrival.at, lambda t, x=listener: self._arrive(x, t))

    # ------------------------------------------------------------------ clients
    def _call(self, fn, *args):
        self._called = True  # the engine's wake: the loop plans again before it idles
        out = fn(*args)
        events = self.scheduler.drain_outbox()
        if events:
            self._deliver(events)
        return out

    def _arrive(self, x: Listener, t: float) -> None:
        a = x.arrival
        layout = "whole" if a.mode == "whole" else "dual"
        try:
            x.cid = self._call(lambda: self.scheduler.open_context(
                self.voice, SamplingParams(seed=a.index, min_frames=0), t, layout=layout,
                reports_onset=self.options.reports_onset, realtime=True))
        except AdmissionRefused as exc:
            x.refused = str(exc)
            return
        self.by_cid[x.cid] = x
        if a.mode == "whole":
            self._call(self.scheduler.append_text, x.cid, [i for w in a.words for i in w], t)
            self._call(self.scheduler.end_segment, x.cid, a.word_count, t, True)
            return
        for k, ids in enumerate(a.words):
            last = k == a.word_count - 1
            when = t + k * self.options.word_interval_s
            self.events.at(when, lambda tw, ids=ids, last=last: self._word(x, ids, last, tw))

    def _word(self, x: Listener, ids: list[int], last: bool, t: float) -> None:
        self._call(self.scheduler.append_text, x.cid, ids, t)
        if last:
            self._call(self.scheduler.end_segment, x.cid, x.arrival.word_count, t, True)

    def _ack(self, x: Listener, t: float) -> None:
        if x.done_at is not None:
            return
        played_ms, state, buffered_ms = x.report(t)
        self._call(self.scheduler.playback, x.cid, played_ms, state, buffered_ms, t)
        self.events.at(t + self.options.ack_interval_s, lambda ta: self._ack(x, ta))

    def _deliver(self, events: list[EngineEvent]) -> None:
        now = self.clock()
        for e in events:
            x = self.by_cid.get(e.cid)
            if x is None:
                continue
            if isinstance(e, AudioChunk):
                was_playing = x.first_audible_at is not None
                x.packet(now, e, x.arrival.silent_frames)
                if not was_playing and x.first_audible_at is not None:
                    if self.options.reports_onset:  # the server's trimmer (its executor hop is not modelled)
                        self.scheduler.mark_audible(e.cid, e.segment, x.dropped_s if e.segment == 0 else 0.0, now)
                    if self.options.ack_interval_s > 0:  # the player acks from its first audible audio either way
                        self.events.at(now + self.options.ack_interval_s, lambda ta, x=x: self._ack(x, ta))
            elif isinstance(e, ContextDone):
                x.done_at = now

    def _sleep(self, seconds: float) -> None:
        """The engine thread's late-planning wait: any event (a call from the server) wakes it, as wake does."""
        until = self.clock.t + seconds
        nxt = self.events.next_time()
        self.clock.t = until if nxt is None else min(until, max(nxt, self.clock.t))
        self.events.run_until(self.clock.t)

    # ------------------------------------------------------------------ loop
    def run(self) -> SimReport:
        """The engine thread's loop (EngineCore._run) on simulated time: idle waits jump to the next event."""
        last_arrival = max((x.arrival.at for x in self.listeners), default=0.0)
        stop = last_arrival + self.options.drain_s
        while self.clock.t < stop:
            self.events.run_until(self.clock.t)
            self._called = False
            if self.core.step() or self.core.busy or self._called:
                continue
            nxt = min((t for t in (self.events.next_time(), self.scheduler.held_until) if t is not None),
                      default=None)
            if nxt is None:
                break
            self.clock.t = max(self.clock.t, nxt)
        cache = self.prefix_cache.stats()
        return SimReport(self.listeners, self.runner.steps, self.runner.busy_s, max(self.clock.t, 1e-9),
                         self.options, {"prefix_cache": {"hits": cache.hits, "misses": cache.misses}})


def _bench_length(cfg: SchedulerConfig, frames_per_word: int) -> SchedulerConfig:
    from dataclasses import replace

    return replace(cfg, bench_frames_per_word=frames_per_word)


def simulate(cfg: SchedulerConfig, profile: StageProfile, arrivals: list[Arrival],
             options: SimOptions | None = None) -> SimReport:
    return Simulation(cfg, profile, arrivals, options).run()


__all__ = ["FRAME_S", "Listener", "SimOptions", "SimReport", "Simulation", "simulate"]
