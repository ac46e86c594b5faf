"""A simulated GPU behind the runner's interface: a clock, a stream-ordered device, and timed external events.

`SimRunner.launch` costs the host `host_step_s` (planning, launch, bookkeeping of one iteration), then queues the
step on the device: it starts when the device is free and runs for the profile's time. `collect` waits for the
step's end (the clock jumps there) and returns what the real runner returns one iteration late: EOS flags
(always false: the simulator runs the benchmark's length mode), PCM and codes. The real EngineCore drives it, so
its launch-before-collect contract is what is simulated, not a model of it.

A prefill is costed at the positions it runs: with the prompt-prefix cache (`prefix_cache`, the engine's own LRU
policy, engine/prefix_cache.py, holding only sizes here) a row whose prefix is cached runs only what follows it,
padded to the runner's power-of-two length buckets, as the runner does.

Events (arrivals, words, playback acks) are callbacks at fixed times; they run whenever the clock passes them,
including while the host waits in `collect`, each with its own timestamp, as the server's calls do.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.prefix_cache import PrefixLRU
from engine.sim.profile import StageProfile, graph_bucket
from engine.types import Stage, StagePlan, StageResult

SAMPLES_PER_FRAME = 1920
AUDIBLE_LEVEL = 0.1  # -23 dBFS peak: a sine this loud is audible by any onset rule


class SimClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Events:
    """Callbacks at fixed times, run in time order as the clock passes them."""

    def __init__(self, clock: SimClock):
        self.clock = clock
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def next_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def run_until(self, t: float) -> None:
        while self._heap and self._heap[0][0] <= t:
            at, _, fn = heapq.heappop(self._heap)
            fn(at)


@dataclass
class SimPending:
    plan: StagePlan
    started: float  # device start
    end: float  # device end
    seconds: float


class Audio:
    """PCM the simulated codec returns: silent frames are zeros, speech a sine well above any audibility rule."""

    def __init__(self, max_chunk: int):
        n = max_chunk * SAMPLES_PER_FRAME
        self.silence = np.zeros(n, np.float32)
        self.speech = (AUDIBLE_LEVEL * np.sin(np.arange(n) * 2 * np.pi * 220 / 24000)).astype(np.float32)
        self.codes = np.zeros((max_chunk, 16), np.int64)

    def chunk(self, first: int, frames: int, silent_frames: int) -> np.ndarray:
        """[frames * 1920] float32 of frames first .. first + frames - 1 of a segment."""
        n = frames * SAMPLES_PER_FRAME
        silent = min(max(silent_frames - first, 0), frames) * SAMPLES_PER_FRAME
        if silent == 0:
            return self.speech[:n]
        if silent == n:
            return self.silence[:n]
        return np.concatenate((self.silence[:silent], self.speech[silent:n]))


class SimRunner:
    """The runner's launch/collect on a simulated device."""

    def __init__(self, profile: StageProfile, clock: SimClock, events: Events, host_step_s: float,
                 silent_frames: Callable[[int], int], max_chunk: int, prefix_cache: PrefixLRU | None = None,
                 prefix_position_bytes: int = 0):
        self.profile, self.clock, self.events, self.host_step_s = profile, clock, events, host_step_s
        self.prefix_cache = PrefixLRU(0, 0) if prefix_cache is None else prefix_cache  # values: positions
        self.prefix_position_bytes = prefix_position_bytes  # Talker keys and values of one prompt position
        self.silent_frames = silent_frames  # context id -> leading silent frames of its speech
        self.audio = Audio(max_chunk)
        self.device_free_at = 0.0
        # Two lanes (first_audio_lane): each lane a stream, run side by side; a step that overlaps the other
        # lane's work takes lane_slowdown times its profile time (they share the SMs and the memory bandwidth).
        self.lane_free_at: dict[str, float] = {}
        self.lane_slowdown = 1.0
        self.busy_s = 0.0
        self.steps: list[tuple[Stage, int, int, float, float]] = []  # stage, rows, chunk, start, seconds

    def launch(self, plan: StagePlan) -> SimPending:
        self.clock.t += self.host_step_s
        self.events.run_until(self.clock.t)
        chunk = max(r.chunk for r in plan.rows) if plan.stage == Stage.CODEC else 0  # padded to the largest
        if plan.stage in (Stage.PREFILL, Stage.FIRST_AUDIO):
            chunk = self._prefill_positions([r.prompt for r in plan.rows])
        seconds = self.profile.step_s(plan.stage, len(plan.rows), chunk)
        if plan.lane is None:
            start = max(self.clock.t, self.device_free_at)
            self.device_free_at = start + seconds
        else:
            start = max(self.clock.t, self.lane_free_at.get(plan.lane, 0.0),
                        self.lane_free_at.get(plan.wait_lane, 0.0) if plan.wait_lane else 0.0)
            if any(end > start for lane, end in self.lane_free_at.items() if lane != plan.lane):
                seconds *= self.lane_slowdown
            self.lane_free_at[plan.lane] = start + seconds
        self.busy_s += seconds
        self.steps.append((plan.stage, len(plan.rows), chunk, start, seconds))
        return SimPending(plan, start, start + seconds, seconds)

    def _prefill_positions(self, prompts) -> int:
        """The length bucket a prefill runs: its rows' positions after their cached prefixes (the runner's
        _load_prefixes and _keep_prefixes, on sizes)."""
        starts, _ = self.prefix_cache.find(prompts)
        self.prefix_cache.keep(prompts, starts, lambda i, p: (p.prefix_len, p.prefix_len * self.prefix_position_bytes))
        return graph_bucket(max(len(p) - start for p, start in zip(prompts, starts, strict=True)))

    def ready(self, pending: SimPending) -> bool:
        return self.clock.t >= pending.end

    def collect(self, pending: SimPending) -> StageResult:
        self.events.run_until(pending.end)  # the host waits; the server's calls go on meanwhile
        self.clock.t = max(self.clock.t, pending.end)
        plan = pending.plan
        result = StageResult(plan.stage, [r.rid for r in plan.rows], pending.seconds)
        result.failed = [None] * len(plan.rows)
        if plan.stage in (Stage.PREFILL, Stage.FIRST_AUDIO, Stage.TALKER):
            result.eos = [False] * len(plan.rows)
        if plan.stage in (Stage.CODEC, Stage.FIRST_AUDIO):
            result.pcm = [self.audio.chunk(r.frame, r.chunk, self.silent_frames(r.cid)) for r in plan.rows]
            result.codes = [self.audio.codes[: r.chunk] for r in plan.rows]
        return result
