"""Pacing (SchedulerConfig.pace_buffer_s): at light load a real-time stream whose listener has enough audio
buffered waits, so the device idles and the streams' steps batch together. The scheduler's decision on a fake
clock, the engine loop's wake-up, the simulator's account, and the doors' real-time flag."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from fake_engine import FakeEngine
from starlette.testclient import TestClient
from test_scheduler import MODEL, Clock, FakeRunner
from test_sim import ROOT

from engine import Overloaded, SamplingParams
from engine.config import EngineConfig, EngineConfigError, SchedulerConfig
from engine.core import POLL_S, EngineCore
from engine.engine import Engine
from engine.model.prompt import resolve_voice
from engine.remote import RemoteEngine
from engine.scheduler import Scheduler
from engine.sim.profile import StageProfile
from engine.sim.run import SimOptions, simulate
from engine.sim.workload import poisson_workload
from engine.text.tokenizer import TextTokenizer
from engine.trace import Timeline
from engine.types import AudioChunk
from server.cli import engine_process_main
from server.config import ServerConfig
from server.runtime import Runtime

PACED = SchedulerConfig(max_slots=8, pace_buffer_s=1.0)


def playing(cfg: SchedulerConfig, n: int, realtime=True):
    """n contexts of one long segment each, stepped until every one has delivered audio."""
    clock = Clock()
    sched = Scheduler(cfg, MODEL, Timeline())
    runner = FakeRunner(clock)
    emitted = []
    core = EngineCore(sched, runner, emitted.extend, sched.timeline, clock)
    flags = realtime if isinstance(realtime, list) else [realtime] * n
    cids = []
    for flag in flags:
        cid = sched.open_context(resolve_voice(MODEL, "ryan", "english"), SamplingParams(max_frames=400, min_frames=2),
                                 clock(), realtime=flag)
        sched.append_text(cid, list(range(100, 140)), clock())
        sched.end_segment(cid, 40, clock(), close=True)
        cids.append(cid)
    while not all(any(isinstance(e, AudioChunk) and e.cid == c for e in emitted) for c in cids):
        core.step()
    core._finish(core.in_flight)  # the step in flight lands: the plans below start from an idle device
    core.in_flight = None
    return sched, core, clock, cids


def buffered(sched, clock, seconds: dict[int, float]) -> None:
    """Each listener reports this much audio buffered now."""
    for cid, s in seconds.items():
        sched.playback(cid, 0.0, "playing", s * 1000, clock())


def test_streams_with_enough_buffered_wait_until_the_first_runs_low_then_run_together():
    sched, core, clock, (a, b) = playing(PACED, 2)
    buffered(sched, clock, {a: 1.5, b: 2.5})
    now = clock()
    assert sched.plan(now) is None
    assert sched.held_until == pytest.approx(now + 0.5)  # a's listener drops to 1 s buffered then
    clock.t = sched.held_until + 0.001
    plan = sched.plan(clock())
    assert plan is not None and sched.held_until is None
    assert {r.cid for r in plan.rows} == {a, b}  # b, with plenty buffered, rides along in the same step


def test_no_hold_when_off_over_the_context_limit_or_for_a_stream_that_is_not_realtime():
    for cfg, realtime in ((replace(PACED, pace_buffer_s=0.0), True),  # off
                          (replace(PACED, pace_max_contexts=1), True),  # two open, at most one for pacing
                          (PACED, [True, False])):  # a file being written never waits, and takes the other along
        sched, core, clock, (a, b) = playing(cfg, 2, realtime)
        buffered(sched, clock, {a: 3.0, b: 3.0})
        plan = sched.plan(clock())
        assert plan is not None and sched.held_until is None, (cfg, realtime)
    # half the slots by default: 8 slots hold pacing for up to 4 contexts
    sched, core, clock, cids = playing(PACED, 5)
    buffered(sched, clock, dict.fromkeys(cids, 3.0))
    assert sched.plan(clock()) is not None


def test_a_listener_short_of_the_pace_buffer_runs_at_once():
    sched, core, clock, (a, b) = playing(PACED, 2)
    buffered(sched, clock, {a: 0.9, b: 3.0})
    plan = sched.plan(clock())
    assert plan is not None and a in {r.cid for r in plan.rows}


def test_pacing_settings_are_validated():
    with pytest.raises(EngineConfigError, match="pace_buffer_s"):
        SchedulerConfig(pace_buffer_s=-1).validate()
    with pytest.raises(EngineConfigError, match="pace_max_contexts"):
        SchedulerConfig(pace_max_contexts=-2).validate()


def test_the_idle_loop_wakes_when_the_hold_ends():
    sched, core, clock, (a, b) = playing(PACED, 2)
    buffered(sched, clock, {a: 1.02, b: 2.0})
    assert not core.step() and not core.busy  # held: nothing launched
    assert core._idle_wait_s() == pytest.approx(0.02)  # not the idle loop's 50 ms
    clock.t += 0.03
    assert core._idle_wait_s() == POLL_S  # past it: look again at once
    sched.held_until = None
    assert core._idle_wait_s() == 0.05


def test_simulated_pacing_idles_the_device_without_underruns_and_keeps_first_audio():
    """Word by word at 1 RPS on a measured H200 profile: with a 1 s pace buffer the device is busy less, steps hold
    more rows, nobody underruns and first audio is no later at the median. A word that arrives while the engine
    collects a step is planned before the loop idles (the engine's wake-up): without that, in this run a held
    stream's last words waited 0.76 s for the next arrival and its listener ran dry."""
    profile = StageProfile.from_json(ROOT / "docs/benchmarks/h200/stages_1p7b_78cded6.json")
    arrivals = poisson_workload(1.0, 60.0, seed=0, mode="streamed")
    base = replace(SchedulerConfig(max_slots=64), bench_frames_per_word=5)
    eager = simulate(base, profile, arrivals, SimOptions()).summary()
    paced = simulate(replace(base, pace_buffer_s=1.0), profile, arrivals, SimOptions()).summary()
    assert eager["underrun_requests"] == 0 and paced["underrun_requests"] == 0
    assert paced["gpu_busy"] < 0.75 * eager["gpu_busy"], (paced["gpu_busy"], eager["gpu_busy"])
    assert paced["stages"]["talker"]["mean_rows"] > 1.3 * eager["stages"]["talker"]["mean_rows"]
    assert paced["ttfa_ms"]["p50"] <= eager["ttfa_ms"]["p50"] + 0.05


class RecordingEngine(FakeEngine):
    """Records the ContextSpec each context opens with and refuses it (the door answers 503, nothing runs)."""

    def __init__(self):
        super().__init__()
        self.specs = []

    def open_context_pipelined(self, spec):
        self.specs.append(spec)
        raise Overloaded("recording only")

    open_context = open_context_pipelined


def test_http_streams_are_realtime_and_a_whole_file_is_not(tiny_checkpoint):
    from server.app import create_app

    engine = RecordingEngine()
    client = TestClient(create_app(Runtime(ServerConfig(), engine, TextTokenizer.from_dir(tiny_checkpoint))))
    for stream in (True, False, None):
        body = {"input": "Hello there.", "voice": "ryan", "response_format": "pcm"}
        if stream is not None:
            body["stream"] = stream
        assert client.post("/v1/audio/speech", json=body).status_code == 503
    assert [s.realtime for s in engine.specs] == [True, False, True]  # stream defaults to true


def test_a_drain_ends_pacing_in_this_process_and_in_the_engine_process(tiny_checkpoint, tiny_model):
    """Held streams would finish at their listeners' pace, past the drain's deadline: draining ends pacing."""
    sched, core, clock, (a, b) = playing(PACED, 2)
    buffered(sched, clock, {a: 3.0, b: 3.0})
    assert sched.plan(clock()) is None and sched.stats().pacing
    sched.pacing = False
    assert sched.plan(clock()) is not None and not sched.stats().pacing
    config = EngineConfig(scheduler=SchedulerConfig(max_slots=4, pace_buffer_s=1.0), max_frames=64,
                          max_prompt_tokens=96)
    engine = Engine(tiny_model, config)
    try:
        assert engine.stats().pacing
        engine.end_pacing()
        assert not engine.stats().pacing
    finally:
        engine.stop()
    cfg = ServerConfig(model=str(tiny_checkpoint), device="cpu", dtype="float32", cpu_threads=2, warmup=False,
                       log_level="warning", engine=config)
    remote = RemoteEngine.spawn(engine_process_main, cfg, start_timeout_s=300)
    try:
        rt = Runtime(cfg, remote, TextTokenizer.from_dir(tiny_checkpoint))
        assert remote.stats().pacing

        async def drain():
            rt.start_drain()

        asyncio.run(drain())
        assert not remote.stats().pacing  # the one-way command went ahead of the call, on the same pipe
    finally:
        remote.stop()
