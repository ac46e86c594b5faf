"""Scheduler policy on the CPU with fabricated stage results and a fake clock (no model, no torch)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from engine.config import SchedulerConfig
from engine.core import EngineCore
from engine.model.config import ModelConfig
from engine.model.presets import model_config
from engine.model.prompt import resolve_voice
from engine.model.sampling_params import SamplingParams
from engine.request import PlaybackClock
from engine.scheduler import AdmissionRefused, Scheduler
from engine.trace import Timeline
from engine.types import AudioChunk, ContextDone, Stage, StagePlan, StageResult


def three_steps(**settings) -> SchedulerConfig:
    """A SchedulerConfig whose segments start with three steps (PREFILL, CODE_PREDICTOR, CODEC), each collected one
    step late: the mechanics these tests pin. The first-audio chain and its early collect (on by default) have
    tests of their own, which turn them on here by name."""
    return SchedulerConfig(**{"first_audio_chain": False, "collect_first_audio_at_once": False, **settings})

MODEL = ModelConfig.from_dict(model_config("tiny"))
SPF = 1920


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@dataclass
class FakePending:
    plan: StagePlan
    started: float


class FakeRunner:
    """Fabricates stage results. EOS comes at a chosen code-0 index per context; audio samples carry the frame."""

    def __init__(self, clock: Clock, eos_at: dict[int, int] | None = None, step_s: float = 0.002):
        self.clock, self.eos_at, self.step_s = clock, eos_at or {}, step_s
        self.plans: list[StagePlan] = []

    def launch(self, plan):
        self.plans.append(plan)
        self.clock.t += self.step_s
        return FakePending(plan, self.clock.t)

    def collect(self, pending):
        plan = pending.plan
        res = StageResult(plan.stage, [r.rid for r in plan.rows], self.step_s)
        res.failed = [None] * len(plan.rows)
        start = pending.started - self.step_s  # the step ran while launch advanced the clock
        if plan.stage == Stage.FIRST_AUDIO:  # its three parts, a third of the step each
            bounds = [start + self.step_s * k / 3 for k in range(4)]
            res.device_spans = {part: (bounds[k], bounds[k + 1])
                                for k, part in enumerate(("prefill", "code_predictor", "codec"))}
        else:
            res.device_spans = {plan.stage.value: (start, pending.started)}
        if plan.stage in (Stage.PREFILL, Stage.FIRST_AUDIO, Stage.TALKER):
            index = [r.frame + 1 if plan.stage == Stage.TALKER else 0 for r in plan.rows]
            res.eos = [self.eos_at.get(r.cid) == i for r, i in zip(plan.rows, index, strict=True)]
        if plan.stage in (Stage.CODEC, Stage.FIRST_AUDIO):
            res.codes = [np.repeat(np.arange(r.frame, r.frame + r.chunk)[:, None], 16, 1) for r in plan.rows]
            res.pcm = [np.repeat(np.arange(r.frame, r.frame + r.chunk), SPF).astype(np.float32) for r in plan.rows]
        return res


def make(cfg: SchedulerConfig | None = None, eos_at=None):
    clock = Clock()
    sched = Scheduler(cfg or three_steps(max_slots=16), MODEL, Timeline())
    runner = FakeRunner(clock, eos_at)
    emitted = []
    core = EngineCore(sched, runner, emitted.extend, sched.timeline, clock)
    return sched, core, runner, clock, emitted


def open_ctx(sched, clock, words=3, close=True, max_frames=50, layout="dual", min_frames=2):
    cid = sched.open_context(resolve_voice(MODEL, "ryan", "english"),
                             SamplingParams(max_frames=max_frames, min_frames=min_frames), clock(), layout=layout)
    if words:
        sched.append_text(cid, list(range(100, 100 + words)), clock())
    if close:
        sched.end_segment(cid, words, clock(), close=True)
    return cid


def audio(emitted, cid):
    return [e for e in emitted if e.cid == cid and isinstance(e, AudioChunk)]


def test_burst_of_arrivals_is_prefilled_together_and_all_get_audio():
    sched, core, runner, clock, emitted = make(eos_at={})
    cids = [open_ctx(sched, clock, max_frames=8) for _ in range(10)]
    core.step()
    assert runner.plans[0].stage == Stage.PREFILL and len(runner.plans[0].rows) == 10
    core.run_until_idle()
    for cid in cids:
        frames = [int(f) for e in audio(emitted, cid) for f in e.codes[:, 0]]
        assert frames == list(range(8))  # in order, nothing lost, nothing twice
        done = [e for e in emitted if e.cid == cid and isinstance(e, ContextDone)]
        assert len(done) == 1 and done[0].reason == "max_frames"
    assert sched.stats().contexts == 0 and sched.stats().free_slots == 16


def test_eos_read_one_iteration_late_drops_the_speculative_frame():
    sched, core, runner, clock, emitted = make(eos_at={})
    cid = open_ctx(sched, clock, max_frames=40)
    runner.eos_at[cid] = 5  # code 0 of frame 5 is EOS: the segment has frames 0..4
    core.run_until_idle()
    frames = [int(f) for e in audio(emitted, cid) for f in e.codes[:, 0]]
    assert frames == [0, 1, 2, 3, 4]
    cp_frames = [r.frame for p in runner.plans if p.stage == Stage.CODE_PREDICTOR for r in p.rows]
    assert max(cp_frames) <= 5  # at most one wasted frame past EOS
    assert [e.reason for e in emitted if isinstance(e, ContextDone)] == ["completed"]


def test_text_starved_request_waits_and_never_reads_padding():
    sched, core, runner, clock, emitted = make()
    starved = open_ctx(sched, clock, words=2, close=False, max_frames=30)
    other = open_ctx(sched, clock, words=3, max_frames=6)
    for _ in range(40):
        core.step()
    talker_rows = [r for p in runner.plans if p.stage == Stage.TALKER for r in p.rows if r.cid == starved]
    assert [r.text_id for r in talker_rows] == [101]  # step 0 read text[1]; step 1 needs text[2]: waiting
    assert sched.stats().text_starved == 1
    assert any(isinstance(e, ContextDone) for e in emitted if e.cid == other)  # the other context went on
    sched.append_text(starved, [102, 103], clock())
    sched.end_segment(starved, 4, clock(), close=True)
    core.run_until_idle()
    talker_rows = [r for p in runner.plans if p.stage == Stage.TALKER for r in p.rows if r.cid == starved]
    assert [r.text_id for r in talker_rows][:4] == [101, 102, 103, MODEL.tts_eos_id]
    assert all(r.text_id is not None for r in talker_rows)


def test_stream_about_to_underrun_is_the_anchor():
    sched, core, runner, clock, emitted = make(three_steps(max_slots=8, safety_lead_s=0.1))
    calm, urgent = open_ctx(sched, clock, max_frames=200), open_ctx(sched, clock, max_frames=200)
    for _ in range(30):
        core.step()
    # Both play; the listener of `urgent` has almost nothing left, `calm` has plenty.
    now = clock()
    sched.playback(calm, 0.0, "playing", None, now)
    delivered = sched.contexts[urgent].clock.delivered_s
    sched.playback(urgent, delivered * 1000 - 50, "playing", None, now)  # 50 ms left < 100 ms safety lead
    r_calm, r_urgent = sched.segments[calm][0], sched.segments[urgent][0]
    assert sched.deadline(r_urgent, now) <= now < sched.deadline(r_calm, now)
    preferred = Stage.CODEC if sched.codec_chunk(r_urgent) else sched.generation_stage(r_urgent)
    plan = sched.plan(now)
    assert plan.stage == preferred and plan.rows[0].cid == urgent


def test_throughput_mode_when_nothing_is_urgent_runs_the_biggest_group():
    sched, core, runner, clock, emitted = make()
    cids = [open_ctx(sched, clock, max_frames=100) for _ in range(3)]
    for _ in range(12):
        core.step()
    for cid in cids:  # everyone has a deep buffer: nothing is urgent
        sched.contexts[cid].clock.first_sent_at = clock() + 100
    waiting = sched.stats().queue_depth  # requests runnable at each stage, before planning
    assert all(sched.deadline(r, clock()) > clock() for r in sched._heads())  # throughput mode
    plan = sched.plan(clock())
    assert len(plan.rows) == max(waiting.values()) and waiting[plan.stage.value] == len(plan.rows)


def test_cancel_mid_batch_frees_the_slot_and_emits_nothing_after():
    sched, core, runner, clock, emitted = make()
    a, b = open_ctx(sched, clock, max_frames=30), open_ctx(sched, clock, max_frames=10)
    for _ in range(8):
        core.step()
    assert core.in_flight is not None and a in [r.cid for r in core.in_flight.plan.rows]
    sched.cancel(a, clock())
    emitted.extend(sched.drain_outbox())
    cancelled_at = len(emitted)
    core.run_until_idle()
    assert isinstance([e for e in emitted if e.cid == a][-1], ContextDone)
    assert not [e for e in emitted[cancelled_at:] if e.cid == a]
    assert [e.reason for e in emitted if e.cid == b and isinstance(e, ContextDone)] == ["max_frames"]
    assert sched.stats().free_slots == 16 and not sched.requests


def test_admission_refuses_when_slots_or_predicted_time_run_out():
    sched, core, runner, clock, emitted = make(three_steps(max_slots=2))
    open_ctx(sched, clock), open_ctx(sched, clock)
    with pytest.raises(AdmissionRefused, match="slots"):
        open_ctx(sched, clock)
    sched2, *_ = make(three_steps(max_slots=64, admission_load=0.8))
    for batch in (1, 4, 8):  # 30 ms per Talker or Code Predictor step: three streams already fill 80 ms
        for stage in (Stage.TALKER, Stage.CODE_PREDICTOR):
            sched2.costs.observe(stage, batch, 0.030 + 0.001 * batch)
    open_ctx(sched2, Clock())
    with pytest.raises(AdmissionRefused, match="predicted"):
        open_ctx(sched2, Clock())


def test_no_stream_starves_under_random_load():
    rng = random.Random(4)
    cfg = three_steps(max_slots=16, max_batch={"prefill": 2, "talker": 3, "code_predictor": 3, "codec": 2})
    clock = Clock()
    sched = Scheduler(cfg, MODEL, Timeline())
    runner = FakeRunner(clock)
    served: dict[int, list[float]] = {}

    def deliver(emits):
        for e in emits:
            served.setdefault(e.cid, []).append(clock())
            if isinstance(e, ContextDone):
                served[e.cid].append(-1.0)

    core = EngineCore(sched, runner, deliver, sched.timeline, clock)
    cids = []
    for _ in range(300):
        if len(sched.contexts) < 12 and rng.random() < 0.3:
            cids.append(open_ctx(sched, clock, words=rng.randint(1, 6), max_frames=rng.randint(3, 25)))
            served.setdefault(cids[-1], []).append(clock())
        core.step()
        clock.t += rng.random() * 0.01
    core.run_until_idle()
    for cid in cids:
        times = served[cid]
        assert times[-1] == -1.0, f"context {cid} never finished"
        gaps = np.diff(times[:-1])
        assert gaps.max() < 1.5, f"context {cid} waited {gaps.max():.2f} s between outputs"
    assert sched.stats().contexts == 0 and sched.stats().free_slots == 16


def test_timeline_exports_chrome_trace():
    sched, core, runner, clock, emitted = make()
    cid = open_ctx(sched, clock, max_frames=4)
    sched.timeline.name_context(cid, "trace-abc")
    core.run_until_idle()
    names = [e["name"] for e in sched.timeline.for_context(cid)]
    for milestone in ("admitted", "first_text", "prefill", "first_audio", "segment_done", "done"):
        assert milestone in names
    import json

    trace = json.loads(sched.timeline.chrome_trace())
    assert any(e.get("ph") == "X" and e["name"] == "codec" for e in trace["traceEvents"])


def test_client_buffer_level_and_state_drive_urgency():
    sched, core, runner, clock, emitted = make(three_steps(max_slots=8, safety_lead_s=0.1))
    cid = open_ctx(sched, clock, max_frames=200)
    for _ in range(30):
        core.step()
    ctx, req = sched.contexts[cid], sched.segments[cid][0]
    now = clock()
    assert ctx.clock.delivered_s > 0.3
    sched.playback(cid, 0.0, "playing", None, now)  # nothing played yet: all delivered audio is ahead
    assert sched.deadline(req, now) > now
    # The player says its buffer holds only 50 ms (the rest is still in flight): urgent now.
    sched.playback(cid, 0.0, "playing", 50.0, now)
    assert ctx.clock.buffer_empty_at() == pytest.approx(now + 0.05)
    assert sched.deadline(req, now) <= now
    # Audio delivered after the report extends the buffer.
    ctx.clock.delivered_s += 1.0
    assert ctx.clock.buffer_empty_at() == pytest.approx(now + 1.05)
    # A player that reports an underrun is waiting right now, whatever was delivered.
    sched.playback(cid, 0.0, "underrun", None, now)
    assert sched.deadline(req, now) <= now


def test_the_cost_model_fits_codec_steps_of_every_chunk_size_as_frame_rows():
    """Codec steps of 1 and 12 frames per row cost very differently at the same batch size: fitted per frame-row,
    they predict the per-frame codec share of a round; fitted per row, they would not."""
    from engine.cost_model import CostModel

    def true_codec_s(batch, frames):
        return 0.002 + 0.00015 * batch * frames

    costs = CostModel()
    for batch in (2, 5, 9, 16, 30):
        for frames in (1, 2, 4, 8, 12):
            costs.observe(Stage.CODEC, batch, true_codec_s(batch, frames), frames)
    for streams in (8, 40):
        assert costs.step_s(Stage.CODEC, streams, 12) == pytest.approx(true_codec_s(streams, 12), rel=0.02)
        assert costs.step_s(Stage.CODEC, streams, 1) == pytest.approx(true_codec_s(streams, 1), rel=0.05)
        costs.observe(Stage.TALKER, streams, 0.010)
        costs.observe(Stage.CODE_PREDICTOR, streams, 0.015)
    round_40 = costs.round_s(40, 12)
    assert round_40 == pytest.approx(0.010 + 0.015 + true_codec_s(40, 12) / 12, rel=0.05)


def test_scheduler_teaches_the_cost_model_each_codec_steps_chunk():
    sched, *_ = make(three_steps(max_slots=4))
    seen = []
    sched.costs.observe = lambda stage, batch, seconds, frames=1: seen.append((stage, batch, frames))
    codes = [None, np.zeros((8, 16), np.int64)]  # a failed row has no codes
    sched.update(StageResult(Stage.CODEC, [], 0.01, pcm=[None, np.zeros(8 * 1920)], codes=codes), 0.0)
    sched.update(StageResult(Stage.TALKER, [], 0.01), 0.0)
    mixed = [np.zeros((n, 16), np.int64) for n in (1, 12, 4)]  # a step of mixed chunks runs padded to its largest
    sched.update(StageResult(Stage.CODEC, [], 0.01, pcm=[np.zeros(len(c) * 1920) for c in mixed], codes=mixed), 0.0)
    assert seen == [(Stage.CODEC, 0, 8), (Stage.TALKER, 0, 1), (Stage.CODEC, 0, 12)]


def test_a_step_predicted_too_long_is_split_so_newcomers_wait_less():
    """The codec's big chunks at large batches are the longest steps; a newcomer waits for the step in flight.
    Batches predicted above max_step_s are cut (at least one row each), and with the cap off they are not."""

    def codec_heavy(stage, batch, frames=1):
        per_row = 0.00015 * frames if stage == Stage.CODEC else 0.0002
        return 0.002 + per_row * batch

    def codec_batches(max_step_s):
        cfg = three_steps(max_slots=24, max_step_s=max_step_s, admission_load=1e6)
        sched, core, runner, clock, emitted = make(cfg)
        cids = [open_ctx(sched, clock, words=20, max_frames=30) for _ in range(24)]
        sched.costs.step_s = codec_heavy  # the fitted model, fixed for the test
        sched.costs.observe = lambda *a, **k: None
        core.run_until_idle()
        assert all(len(audio(emitted, c)) > 0 for c in cids)
        return [(len(p.rows), max(r.chunk for r in p.rows)) for p in runner.plans if p.stage == Stage.CODEC]

    capped = codec_batches(0.021)
    assert all(codec_heavy(Stage.CODEC, n, c) <= 0.021 or n == 1 for n, c in capped)
    assert max(n for n, c in capped if c == 12) == 10  # 0.002 + 0.0018 * 10 = 20 ms; 11 rows: 21.8 ms
    uncapped = codec_batches(0.0)
    assert max(codec_heavy(Stage.CODEC, n, c) for n, c in uncapped) > 0.021  # e.g. 16 rows x 12 frames: 31 ms


# ---------------------------------------------------------------------- first audio first (issue 13)
def serve(sched, runner, clock, until, limit=500):
    """Plan, run and collect one step at a time (no step left in flight) until `until()` holds."""
    emitted = []
    for _ in range(limit):
        if until(emitted):
            return emitted
        plan = sched.plan(clock())
        assert plan is not None, "nothing runnable"
        emitted += sched.update(runner.collect(runner.launch(plan)), clock())
    raise AssertionError("condition not reached")


def playing_and_newcomer(policy, reports_onset=False):
    """One stream playing with some slack (2 chunks, 240 ms, out), then a newcomer."""
    sched, _, runner, clock, _ = make(three_steps(max_slots=16, policy=policy))
    a = sched.open_context(resolve_voice(MODEL, "ryan", "english"), SamplingParams(max_frames=200, min_frames=200),
                           clock(), layout="whole", reports_onset=reports_onset)
    sched.append_text(a, list(range(100, 140)), clock())
    sched.end_segment(a, 40, clock(), close=True)
    serve(sched, runner, clock, lambda em: len(audio(em, a)) >= 2)
    sched.mark_audible(a, 0, 0.0, clock())
    b = open_ctx(sched, clock, words=3, layout="whole", max_frames=20)
    return sched, runner, clock, a, b


@pytest.mark.parametrize("policy", ["first_audio", "edf"])
def test_a_newcomer_runs_ahead_of_a_playing_stream_that_has_slack(policy):
    """The playing stream has delivered 3 frames (240 ms) in about 20 ms of 2 ms steps, so under edf its deadline
    (buffer end - 250 ms safety lead) is earlier than the newcomer's arrival and it keeps the device; under
    first_audio the newcomer's chain (3 steps) plus the stream's next chunk fits in its slack, so the newcomer
    goes first."""
    sched, runner, clock, a, b = playing_and_newcomer(policy)
    ctx_a = sched.contexts[a]
    assert ctx_a.clock.buffer_empty_at() - sched.cfg.safety_lead_s < clock()  # urgent by the edf rule
    plan = sched.plan(clock())
    if policy == "first_audio":
        assert plan.stage == Stage.PREFILL and [r.cid for r in plan.rows] == [b]
    else:
        assert b not in [r.cid for r in plan.rows]


def test_a_playing_stream_about_to_run_dry_goes_ahead_of_a_newcomer():
    sched, runner, clock, a, b = playing_and_newcomer("first_audio")
    empty = sched.contexts[a].clock.buffer_empty_at()
    clock.t = empty - 0.010  # 10 ms of audio left: less than any newcomer chain plus a 4-frame chunk
    plan = sched.plan(clock())
    assert a in [r.cid for r in plan.rows] and plan.stage != Stage.PREFILL


def test_first_audio_class_holds_until_the_reported_onset():
    sched, _, runner, clock, _ = make(three_steps(max_slots=16, first_audio_max_s=0.5))
    voice = resolve_voice(MODEL, "ryan", "english")
    cids = {}
    for name, reports in (("reports", True), ("silent", True), ("plain", False)):
        cids[name] = sched.open_context(voice, SamplingParams(max_frames=40, min_frames=40), clock(), layout="whole",
                                        reports_onset=reports)
        sched.append_text(cids[name], [100, 101, 102], clock())
        sched.end_segment(cids[name], 3, clock(), close=True)
    head = {name: sched.segments[cid][0] for name, cid in cids.items()}
    assert all(sched.in_first_audio_class(r) for r in head.values())
    serve(sched, runner, clock, lambda em: all(audio(em, cid) for cid in cids.values()))
    # a first chunk alone ends the class only for a consumer that reports no onset
    assert not sched.in_first_audio_class(head["plain"])
    assert sched.in_first_audio_class(head["reports"]) and sched.in_first_audio_class(head["silent"])
    sched.mark_audible(cids["reports"], 0, 0.0, clock())
    assert not sched.in_first_audio_class(head["reports"])
    # never reported: the class ends after first_audio_max_s of audio (0.5 s: 7 frames)
    serve(sched, runner, clock, lambda em: head["silent"].frames_emitted * 0.08 >= 0.5)
    assert not sched.in_first_audio_class(head["silent"])


def test_a_later_segment_while_the_listener_still_plays_is_not_a_newcomer():
    sched, _, runner, clock, _ = make()
    cid = open_ctx(sched, clock, words=10, close=False, layout="dual", max_frames=200, min_frames=200)
    sched.end_segment(cid, 10, clock())
    serve(sched, runner, clock, lambda em: len(audio(em, cid)) >= 3)
    sched.append_text(cid, [200, 201], clock())  # segment 1's first text: segment 0's audio still plays
    assert not sched.segments[cid][-1].newcomer


def test_admission_refuses_a_newcomer_whose_predicted_first_audio_is_too_late():
    sched, runner, clock, a, b = playing_and_newcomer("first_audio")
    predicted = sched.predicted_first_audio_s(clock())
    assert predicted is not None and predicted >= 3 * runner.step_s  # at least prefill, CP, codec
    sched.cfg = three_steps(max_slots=16, admission_first_audio_s=predicted * 0.9)
    with pytest.raises(AdmissionRefused, match="predicted first audio"):
        open_ctx(sched, clock)
    sched.cfg = three_steps(max_slots=16, admission_first_audio_s=predicted * 1.5)
    open_ctx(sched, clock)


def test_first_audio_times_ride_on_each_segments_first_chunk_only_in_phase_order():
    """Every segment's first AudioChunk carries when its first audio passed each point, in order; no other chunk
    carries a record. A segment queued behind another and a context arriving while one plays are included."""
    sched, core, runner, clock, emitted = make(eos_at={})
    clock.t = 1.0
    a = open_ctx(sched, clock, words=3, close=False, max_frames=6)
    sched.end_segment(a, 3, clock())
    sched.append_text(a, [200, 201], clock())  # segment 1, queued behind segment 0
    sched.end_segment(a, 2, clock(), close=True)
    for _ in range(6):
        core.step()
    b_text_at = clock()
    b = open_ctx(sched, clock, words=2, max_frames=6)
    core.run_until_idle()
    segments = {(a, 0): 1.0, (a, 1): 1.0, (b, 0): b_text_at}
    for (cid, segment), text_at in segments.items():
        chunks = [e for e in audio(emitted, cid) if e.segment == segment]
        assert len(chunks) >= 2
        assert [e.first_audio is not None for e in chunks] == [True] + [False] * (len(chunks) - 1)
        t = chunks[0].first_audio
        assert t.arrival == text_at
        # the device's points are those of its own steps toward first audio: its prefill, frame 0's Code
        # Predictor, its first codec chunk (not a later frame's step of the same stage)
        assert t.arrival <= t.prefill_planned <= t.prefill_started < t.prefill_done < t.code_predictor_done \
            < t.codec_done <= t.collected
        assert t.codec_done - t.code_predictor_done >= runner.step_s  # three steps: each its own step
        assert t.handed is None and t.received is None  # the engine's hand-off to the event loop stamps those
    first = {(e.cid, e.segment): e.first_audio for e in emitted if isinstance(e, AudioChunk) and e.first_audio}
    assert first[(a, 1)].prefill_planned > first[(a, 0)].collected  # segment 1 waited for segment 0


# ---------------------------------------------------------------------- codec steps of mixed chunk sizes (issue 13)
def ramping_streams(policy, mix_codec_chunks=True):
    """Streams arriving 8 steps apart while the earlier ones ramp up their chunks; codec steps cost 10 ms per frame
    of their padded size (a CPU's codec). Returns each codec plan with the chunk every request could decode just
    before it was planned."""
    cfg = three_steps(max_slots=16, chunk_ramp=(1, 2, 4, 12), policy=policy, admission_load=1e6,
                      admission_first_audio_s=0, mix_codec_chunks=mix_codec_chunks)
    sched, core, runner, clock, emitted = make(cfg)
    steps, plan, launch = [], sched.plan, runner.launch

    def spy(now):
        ready = {r.rid: sched.codec_chunk(r) for r in sched._heads() if sched.codec_chunk(r)}
        p = plan(now)
        if p is not None and p.stage == Stage.CODEC:
            steps.append((p, ready))
        return p

    def slow_codec(p):
        if p.stage == Stage.CODEC:
            clock.t += 0.010 * max(r.chunk for r in p.rows)
        return launch(p)

    sched.plan, runner.launch = spy, slow_codec
    cids = []
    for _ in range(8):
        cids.append(open_ctx(sched, clock, words=10, max_frames=40, min_frames=40))
        for _ in range(8):
            core.step()
    core.run_until_idle()
    for cid in cids:  # every frame once, in order, with its own audio
        assert [int(f) for e in audio(emitted, cid) for f in e.codes[:, 0]] == list(range(40))
        assert all(len(e.pcm) == len(e.codes) * SPF for e in audio(emitted, cid))
    return steps


@pytest.mark.parametrize("policy", ["first_audio", "edf"])
def test_a_codec_step_takes_every_chunk_up_to_the_anchors_and_each_row_decodes_its_own(policy):
    """A codec step runs padded to its anchor's chunk: every request whose own chunk fits rides along, larger
    chunks wait. Ramping streams make such mixed steps; a newcomer anchoring a step gets its first chunk at once,
    in a 1-frame step, while others' larger chunks wait."""
    steps = ramping_streams(policy)
    mixed = first_alone = 0
    for p, ready in steps:
        padded = max(r.chunk for r in p.rows)
        assert all(r.chunk == ready[r.rid] for r in p.rows)  # each row its own chunk
        assert {r.rid for r in p.rows} == {rid for rid, chunk in ready.items() if chunk <= padded}
        mixed += len({r.chunk for r in p.rows}) > 1
        first_alone += padded == 1 and max(ready.values()) > 1 and any(r.frame == 0 for r in p.rows)
    assert mixed > 0
    if policy == "first_audio":
        assert first_alone > 0


def test_uniform_codec_chunks_take_only_the_anchors_size():
    """mix_codec_chunks off (the simulator's comparison): a codec step holds only rows of its anchor's chunk size;
    smaller chunks that would have ridden along wait for a step of their own."""
    steps = ramping_streams("first_audio", mix_codec_chunks=False)
    left_out = 0
    for p, ready in steps:
        size = p.rows[0].chunk
        assert all(r.chunk == size == ready[r.rid] for r in p.rows)
        assert {r.rid for r in p.rows} == {rid for rid, chunk in ready.items() if chunk == size}
        left_out += any(chunk < size for chunk in ready.values())
    assert left_out > 0  # the same load mixes chunks by default (the test above)


def ramping_stream_and_newcomer():
    """A stream whose next chunk (4 frames, ramp 1, 4) and a newcomer whose first chunk (1 frame) are both ready."""
    cfg = three_steps(max_slots=16, chunk_ramp=(1, 4), admission_first_audio_s=0)
    sched, _, runner, clock, _ = make(cfg)
    a = open_ctx(sched, clock, words=40, layout="whole", max_frames=200, min_frames=200)
    ra = sched.segments[a][0]
    serve(sched, runner, clock, lambda em: ra.chunks == 1 and ra.frames_made - ra.frames_decoded == 3
          and sched.generation_stage(ra) == Stage.CODE_PREDICTOR)
    b = open_ctx(sched, clock, words=3, layout="whole", max_frames=20)
    rb = sched.segments[b][0]
    serve(sched, runner, clock, lambda em: sched.codec_chunk(rb) == 1)  # its frame 0 rode in its CP step
    assert sched.codec_chunk(ra) == 4
    return sched, runner, clock, a, b


def test_a_newcomer_anchoring_a_codec_step_gets_its_first_frame_alone():
    sched, runner, clock, a, b = ramping_stream_and_newcomer()
    plan = sched.plan(clock())
    assert plan.stage == Stage.CODEC and [(r.cid, r.frame, r.chunk) for r in plan.rows] == [(b, 0, 1)]


def test_a_newcomers_first_frame_rides_in_the_codec_step_of_a_stream_about_to_run_dry():
    """The playing stream anchors a 4-frame codec step; the newcomer's 1-frame chunk joins it (padded), instead of
    waiting for a step of its own, and each row's audio is its own chunk."""
    sched, runner, clock, a, b = ramping_stream_and_newcomer()
    clock.t = sched.contexts[a].clock.buffer_empty_at() - 0.010
    plan = sched.plan(clock())
    assert plan.stage == Stage.CODEC
    assert [(r.cid, r.frame, r.chunk) for r in plan.rows] == [(a, 1, 4), (b, 0, 1)]
    events = sched.update(runner.collect(runner.launch(plan)), clock())
    assert [(e.cid, e.first_frame, len(e.codes), len(e.pcm)) for e in events] == [(a, 1, 4, 4 * SPF), (b, 0, 1, SPF)]


def test_the_first_audio_chain_emits_what_three_steps_emit():
    """first_audio_chain: each segment starts with one FIRST_AUDIO step (prefill, frame 0, its 1-frame chunk), and
    every context gets the same frames, chunks after the first and endings as with three steps, including a
    context whose very first code 0 is EOS (its chained frame is decoded, never emitted) and one at max_frames 1."""
    def play(chain: bool):
        sched, core, runner, clock, emitted = make(three_steps(max_slots=16, first_audio_chain=chain), eos_at={})
        cids = [open_ctx(sched, clock, max_frames=m, min_frames=0) for m in (9, 1, 20, 14)]
        runner.eos_at[cids[2]] = 0  # EOS at once: the segment has no frame
        runner.eos_at[cids[3]] = 6
        core.step()
        first = runner.plans[0]
        core.run_until_idle()
        late = open_ctx(sched, clock, max_frames=5)  # alone on an idle engine
        core.run_until_idle()
        out = {i: ([int(f) for e in audio(emitted, c) for f in e.codes[:, 0]],
                   [e.reason for e in emitted if e.cid == c and isinstance(e, ContextDone)])
               for i, c in enumerate([*cids, late])}
        return first, out, runner.plans, sched.stats()

    first_three, three, plans_three, _ = play(False)
    first_one, one, plans_one, stats = play(True)
    assert first_three.stage == Stage.PREFILL
    assert first_one.stage == Stage.FIRST_AUDIO and [(r.frame, r.chunk) for r in first_one.rows] == [(0, 1)] * 4
    assert one == three
    assert one[0] == (list(range(9)), ["max_frames"]) and one[1] == ([0], ["max_frames"])
    assert one[2] == ([], ["completed"]) and one[3] == (list(range(6)), ["completed"])
    assert {p.stage for p in plans_one} == {Stage.FIRST_AUDIO, Stage.TALKER, Stage.CODE_PREDICTOR, Stage.CODEC}
    assert not any(r.frame == 0 for p in plans_one if p.stage == Stage.CODE_PREDICTOR for r in p.rows)
    assert len(plans_one) < len(plans_three)
    assert stats.contexts == 0 and stats.free_slots == 16


def test_the_chain_costs_newcomers_as_one_measured_step_and_gives_way_when_long():
    """With the chain on, a newcomer's predicted first audio is the FIRST_AUDIO step's own measured cost, and
    admission uses it. A chain predicted longer than max_step_s (everything arriving meanwhile would wait for all
    of it) gives way to three steps, costed by their parts."""
    sched, core, runner, clock, emitted = make(three_steps(max_slots=16, first_audio_chain=True, max_step_s=0.02))
    assert sched.chaining() and sched.predicted_first_audio_s(clock()) is None  # nothing measured: chain
    sched.costs.observe(Stage.FIRST_AUDIO, 1, 0.007)
    sched.costs.observe(Stage.PREFILL, 1, 0.005)  # three steps' costs, which the measured chain outranks
    sched.costs.observe(Stage.CODE_PREDICTOR, 1, 0.006)
    sched.costs.observe(Stage.CODEC, 1, 0.004)
    assert sched.chaining() and sched.predicted_first_audio_s(clock()) == pytest.approx(0.007)
    cid = open_ctx(sched, clock)
    assert sched.generation_stage(sched.segments[cid][0]) == Stage.FIRST_AUDIO
    assert sched.chain_gave_way is None
    for _ in range(200):  # the chain turns out long: 30 ms
        sched.costs.observe(Stage.FIRST_AUDIO, 1, 0.030)
    assert not sched.chaining() and sched.generation_stage(sched.segments[cid][0]) == Stage.PREFILL
    assert sched.chain_gave_way == "gave way to three steps: the chain is predicted 30.0 ms, over max_step_s 20 ms"
    parts = [sched.costs.rows_s(stage, 2, 1) for stage in (Stage.PREFILL, Stage.CODE_PREDICTOR, Stage.CODEC)]
    assert sched.predicted_first_audio_s(clock()) == pytest.approx(sum(parts))  # it and the one waiting
    assert sum(parts) < sched.costs.rows_s(Stage.FIRST_AUDIO, 2)
    sched.costs.reset()  # (the engine's after its warm-up): unmeasured, it chains again, and says so
    assert sched.chaining() and sched.chain_gave_way is None


@pytest.mark.parametrize("chain", [False, True])
@pytest.mark.parametrize("at_once", [False, True])
def test_a_step_making_first_audio_is_collected_before_the_next_launch_when_asked(at_once, chain):
    """collect_first_audio_at_once: the one-step-late loop launches the next step before it collects the one in
    flight, unless that one makes a segment's first audio (a chained first step or a first codec chunk): then its
    audio is delivered first. Other steps stay one step late either way."""
    cfg = three_steps(max_slots=16, first_audio_chain=chain, collect_first_audio_at_once=at_once)
    sched, core, runner, clock, emitted = make(cfg)
    log = []
    launch = runner.launch
    runner.launch = lambda plan: log.append(("launch", plan.stage, [r.frame for r in plan.rows])) or launch(plan)
    core.deliver = lambda events: log.extend(("audio", e.cid, e.first_frame) for e in events
                                             if isinstance(e, AudioChunk))
    cid = open_ctx(sched, clock, max_frames=6)
    core.run_until_idle()
    first = log.index(("audio", cid, 0))
    stage = Stage.FIRST_AUDIO if chain else Stage.CODEC
    making = max(i for i, x in enumerate(log[:first]) if x == ("launch", stage, [0]))  # the step that made it
    # at once: delivered before anything else is launched; else the next step's launch comes between
    assert first - making == (1 if at_once else 2)
    later = [i for i, x in enumerate(log) if x[0] == "audio" and x[2] > 0]
    assert later and all(log[i - 1][0] == "launch" for i in later)  # the rest one step late


def test_the_loop_counts_its_host_time_and_the_devices_idle_gaps():
    """LoopStats: every launched step counts as an iteration; the engine thread's planning, launching and
    bookkeeping count as host time (the fake launch takes step_s of the fake clock, nothing else takes any); the
    idle gaps the runner measured before each collected step add up, in the histogram's buckets."""
    sched, core, runner, clock, emitted = make(three_steps(max_slots=16))
    collect = runner.collect
    gaps = iter([0.00001, 0.0003, 0.004] * 1000)

    def collect_with_gap(pending):
        result = collect(pending)
        result.idle_before_s = next(gaps)
        return result

    runner.collect = collect_with_gap
    open_ctx(sched, clock, max_frames=5)
    core.run_until_idle()
    loop = core.loop_stats
    n = len(runner.plans)
    assert loop.iterations == n and loop.host_s == pytest.approx(n * runner.step_s)
    assert loop.idle_gaps == n and sum(loop.idle_histogram) == n
    per_gap = [sum(1 for i in range(n) if i % 3 == k) for k in range(3)]  # 10 us, 300 us and 4 ms gaps
    assert [loop.idle_histogram[i] for i in (0, 2, 5)] == per_gap
    assert loop.idle_s == pytest.approx(sum([0.00001, 0.0003, 0.004][i % 3] for i in range(n)))


def test_the_playback_clock_starts_at_the_onset_and_never_counts_trimmed_silence():
    """Without acks the listener plays 1x from its first audible audio, and the leading silence the server's
    trimmer dropped is never played: the onset report carries both to the clock."""
    clock = PlaybackClock(delivered_s=0.24, first_sent_at=10.0)  # three 80 ms chunks, the first at t = 10
    assert clock.buffer_empty_at() == pytest.approx(10.24)
    clock.trimmed_s, clock.audible_sent_at = 0.15, 10.02  # 150 ms dropped; the first audible audio sent at 10.02
    assert clock.buffer_empty_at() == pytest.approx(10.02 + 0.24 - 0.15)
    # With acks (positions on the engine's timeline, silence dropped so far counted as played): silence dropped
    # after the last report is not in the listener's buffer either.
    clock.ack_at, clock.ack_played_s, clock.ack_delivered_s, clock.ack_trimmed_s = 10.1, 0.2, 0.24, 0.15
    clock.delivered_s, clock.trimmed_s = 0.40, 0.20  # 160 ms more sent since, 50 ms of it dropped
    assert clock.buffer_empty_at() == pytest.approx(10.1 + 0.40 - 0.2 - 0.05)
    clock.ack_buffered_s = 0.03
    assert clock.buffer_empty_at() == pytest.approx(10.1 + 0.03 + 0.16 - 0.05)


def test_an_onset_report_reaches_the_clock():
    sched, _, runner, clock, _ = make(three_steps(max_slots=4))
    a = sched.open_context(resolve_voice(MODEL, "ryan", "english"), SamplingParams(max_frames=50, min_frames=50),
                           clock(), layout="whole", reports_onset=True)
    sched.append_text(a, list(range(100, 110)), clock())
    sched.end_segment(a, 10, clock(), close=True)
    serve(sched, runner, clock, lambda em: len(audio(em, a)) >= 2)
    before = sched.contexts[a].clock.buffer_empty_at()
    onset = clock()
    sched.mark_audible(a, 0, 0.1, onset)
    ctx = sched.contexts[a].clock
    assert ctx.audible_sent_at == onset and ctx.trimmed_s == pytest.approx(0.1)
    assert ctx.buffer_empty_at() == pytest.approx(onset + ctx.delivered_s - 0.1) and ctx.buffer_empty_at() != before
    sched.mark_audible(a, 1, 0.05, onset + 1)  # a later segment's silence: dropped too; playback started already
    assert ctx.audible_sent_at == onset and ctx.trimmed_s == pytest.approx(0.15)
