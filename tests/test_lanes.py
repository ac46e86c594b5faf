"""The first-audio lane (SchedulerConfig.first_audio_lane) on a fake two-stream device with a fake clock: a newcomer's
steps launch beside the playing streams' steps instead of behind them, a request's steps move to the main lane
after its first audible audio with the device ordered across the switch, and nothing is lost either way."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from engine.config import EngineConfigError
from engine.core import EngineCore
from engine.scheduler import Scheduler
from engine.trace import Timeline
from engine.types import AudioChunk, ContextDone, Stage, StagePlan, StageResult
from tests.test_scheduler import MODEL, SPF, Clock, open_ctx, three_steps

# A playing stream's codec chunk takes long: what a newcomer would queue behind on one stream.
STEP_S = {Stage.PREFILL: 0.003, Stage.CODE_PREDICTOR: 0.003, Stage.TALKER: 0.002, Stage.CODEC: 0.004}
LONG_CODEC_S = 0.030


@dataclass
class DevicePending:
    plan: StagePlan
    start: float
    end: float

    @property
    def started(self) -> float:  # what the loop's timeline records
        return self.start


class TwoStreamDevice:
    """Each lane is a stream: its steps run one after another, the lanes side by side. A step that must wait for
    the other lane (plan.wait_lane) starts after that lane's queued work. Launches cost the host nothing."""

    def __init__(self, clock: Clock, long_codec_from_chunk: int = 4):
        self.clock, self.long_from = clock, long_codec_from_chunk
        self.free_at: dict[str | None, float] = {}
        self.launched: list[tuple[float, DevicePending]] = []  # (host time of the launch, step)

    def seconds(self, plan: StagePlan) -> float:
        if plan.stage == Stage.CODEC and max(r.chunk for r in plan.rows) >= self.long_from:
            return LONG_CODEC_S
        return STEP_S[plan.stage]

    def launch(self, plan: StagePlan) -> DevicePending:
        start = max(self.clock.t, self.free_at.get(plan.lane, 0.0))
        if plan.wait_lane is not None:
            start = max(start, self.free_at.get(plan.wait_lane, 0.0))
        step = DevicePending(plan, start, start + self.seconds(plan))
        self.free_at[plan.lane] = step.end
        self.launched.append((self.clock.t, step))
        return step

    def ready(self, pending: DevicePending) -> bool:
        return self.clock.t >= pending.end

    def collect(self, pending: DevicePending) -> StageResult:
        self.clock.t = max(self.clock.t, pending.end)
        plan = pending.plan
        res = StageResult(plan.stage, [r.rid for r in plan.rows], pending.end - pending.start)
        res.failed = [None] * len(plan.rows)
        if plan.stage in (Stage.PREFILL, Stage.TALKER):
            res.eos = [False] * len(plan.rows)
        if plan.stage == Stage.CODEC:
            res.codes = [np.repeat(np.arange(r.frame, r.frame + r.chunk)[:, None], 16, 1) for r in plan.rows]
            res.pcm = [np.full(r.chunk * SPF, 0.5, np.float32) for r in plan.rows]
        return res


def make(lanes: bool, arrivals: dict[float, tuple[int, int]]):
    """A scheduler, the loop and the fake device; `arrivals`: time -> (words, max_frames) of a context opened then
    (the loop's waits run them, as the server's calls interrupt the engine thread's waits)."""
    clock = Clock()
    cfg = three_steps(max_slots=16, first_audio_lane=lanes, admission_first_audio_s=0, plan_lead_s=0.002)
    sched = Scheduler(cfg, MODEL, Timeline())
    device = TwoStreamDevice(clock)
    emitted, opened, first_audio = [], {}, {}
    pending = dict(sorted(arrivals.items()))

    def deliver(events) -> None:
        emitted.extend(events)
        for e in events:
            if isinstance(e, AudioChunk):
                first_audio.setdefault(e.cid, clock.t)

    def arrive_until(t: float) -> None:
        for at in [a for a in pending if a <= t]:
            clock.t = max(clock.t, at)
            words, frames = pending.pop(at)
            opened[at] = open_ctx(sched, clock, words=words, max_frames=frames)

    def sleep(seconds: float) -> None:
        until = clock.t + seconds
        nxt = min(pending, default=None)
        clock.t = until if nxt is None else min(until, max(nxt, clock.t))
        arrive_until(clock.t)

    core = EngineCore(sched, device, deliver, sched.timeline, clock, plan_lead_s=0.002, sleep=sleep)

    def run(until: float) -> None:
        while clock.t < until:
            arrive_until(clock.t)
            if not core.step() and not core.busy:
                nxt = min(pending, default=None)
                if nxt is None:
                    return
                clock.t = max(clock.t, nxt)

    return sched, core, device, clock, emitted, opened, first_audio, run


def test_a_newcomer_launches_beside_a_long_playing_step_not_behind_it():
    results = {}
    for lanes in (False, True):
        # A plays and ramps into 30 ms codec chunks; B arrives 5 ms into one of them (found by running A alone).
        *_, device, _, _, _, _, run = make(lanes, {0.0: (30, 200)})
        run(0.6)
        long_step = next(step for _, step in device.launched
                         if step.plan.stage == Stage.CODEC and step.end - step.start == LONG_CODEC_S
                         and step.start > 0.05)
        arrival = long_step.start + 0.005
        *_, device, _, _, opened, first_audio, run = make(lanes, {0.0: (30, 200), arrival: (3, 40)})
        run(arrival + 0.2)
        b = opened[arrival]
        b_prefill = next(step for _, step in device.launched
                         if step.plan.stage == Stage.PREFILL and step.plan.rows[0].cid == b)
        assert [s.start for _, s in device.launched if s.plan.stage == Stage.CODEC].count(long_step.start) == 1
        results[lanes] = (b_prefill, long_step, first_audio[b] - arrival, arrival)
    one_lane_prefill, long_step, one_lane_ttfa, _ = results[False]
    lane_prefill, _, lane_ttfa, arrival = results[True]
    assert one_lane_prefill.start >= long_step.end  # one stream: B's prefill waits for A's long step
    assert lane_prefill.plan.lane == "first" and lane_prefill.start == pytest.approx(arrival)  # its own stream
    # Its first audio: prefill + Code Predictor + a 1-frame codec chunk on the fake device, not a 30 ms wait first.
    assert lane_ttfa <= STEP_S[Stage.PREFILL] + STEP_S[Stage.CODE_PREDICTOR] + STEP_S[Stage.CODEC] + 0.001
    assert one_lane_ttfa > lane_ttfa + 0.015


def test_after_first_audio_a_request_moves_to_the_main_lane_behind_its_own_work():
    sched, core, device, clock, emitted, opened, _, run = make(True, {0.0: (8, 40)})
    run(3.0)
    cid = opened[0.0]
    steps = [step.plan for _, step in device.launched if cid in [r.cid for r in step.plan.rows]]
    lanes = [p.lane for p in steps]
    assert lanes[0] == "first" and "main" in lanes
    switch = lanes.index("main")
    assert set(lanes[:switch]) == {"first"} and set(lanes[switch:]) == {"main"}  # one move, never back
    assert steps[switch].wait_lane == "first"  # the device orders the move
    assert all(p.wait_lane is None for p in steps[switch + 1:])
    # it moved once its first audio was out (no onset reports here: the first chunk ends the class)
    first_chunk = next(i for i, p in enumerate(steps) if p.stage == Stage.CODEC)
    assert first_chunk < switch
    done = [e for e in emitted if isinstance(e, ContextDone) and e.cid == cid]
    assert done and done[0].reason == "max_frames"
    frames = sum(len(e.codes) for e in emitted if isinstance(e, AudioChunk) and e.cid == cid)
    assert frames == 40


def test_two_lanes_lose_nothing_under_staggered_arrivals():
    arrivals = {0.01 * i: (2 + i % 5, 40) for i in range(12)}
    sched, core, device, clock, emitted, opened, _, run = make(True, arrivals)
    run(20.0)
    for cid in opened.values():
        chunks = [e for e in emitted if isinstance(e, AudioChunk) and e.cid == cid]
        assert [c.first_frame for c in chunks] == list(np.cumsum([0] + [len(c.codes) for c in chunks[:-1]]))
        assert sum(len(c.codes) for c in chunks) == 40
        assert [e.reason for e in emitted if isinstance(e, ContextDone) and e.cid == cid] == ["max_frames"]
    first_lane = [step.plan for _, step in device.launched if step.plan.lane == "first"]
    assert max(len(p.rows) for p in first_lane) <= sched.cfg.first_lane_max_batch
    assert sched.stats().free_slots == 16 and not sched.requests


def test_the_first_audio_lane_needs_the_first_audio_policy():
    with pytest.raises(EngineConfigError, match="first_audio_lane"):
        three_steps(first_audio_lane=True, policy="edf").validate()
