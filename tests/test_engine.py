"""The streaming engine end to end on the CPU with the tiny checkpoint: batching, streaming text, segments,
cancel, faults, lengths, and that nothing is left behind."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

from engine.api import ContextSpec, Overloaded
from engine.config import EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.model.sampling_params import SamplingParams
from engine.types import AudioChunk, ContextDone, SegmentDone

TEXT = list(range(3000, 3014))  # 14 text tokens
GREEDY = SamplingParams(temperature=0.0, sub_temperature=0.0, max_frames=16)


def make_engine(model, **sched) -> Engine:
    sched.setdefault("max_slots", 20)
    sched.setdefault("admission_load", 1e6)  # CPU tests: never refuse for speed,
    sched.setdefault("admission_first_audio_s", 0)  # nor for a first audio a loaded CPU would predict late
    engine = Engine(model, EngineConfig(scheduler=SchedulerConfig(**sched), max_frames=64, max_prompt_tokens=96))
    engine.start()
    return engine


@pytest.fixture
def engine(tiny_model):
    e = make_engine(tiny_model)
    yield e
    e.stop()


async def speak(engine, text=TEXT, sampling=GREEDY, words_delay=None, layout="dual", rng=None, segments=None,
                voice="ryan"):
    """Feed text (all at once, or token by token with random pauses), close, collect events."""
    ctx = engine.open_context(ContextSpec(voice=voice, language="english", sampling=sampling, text_layout=layout))
    for seg_text in segments or [text]:
        if words_delay is None:
            ctx.append_text(seg_text)
        else:
            for tok in seg_text:
                ctx.append_text([tok])
                await asyncio.sleep(rng.random() * words_delay)
        if segments:
            ctx.flush(words=len(seg_text))
    ctx.close(words=len(text))
    events = [ev async for ev in ctx.events()]
    return ctx, events


def codes_of(events, segment=None):
    chunks = [e.codes for e in events if isinstance(e, AudioChunk) and (segment is None or e.segment == segment)]
    return np.concatenate(chunks) if chunks else np.zeros((0, 16), np.int64)


def pcm_of(events):
    return np.concatenate([e.pcm for e in events if isinstance(e, AudioChunk)])


def test_batch_invariance_greedy_and_seeded_sampling(engine):
    rng = random.Random(0)
    specs = []
    for i in range(16):
        sampling = GREEDY if i % 2 else SamplingParams(seed=1000 + i, max_frames=16)
        specs.append((TEXT[: rng.randint(3, 14)], sampling.with_overrides(max_frames=rng.randint(6, 16))))

    async def main():
        together = await asyncio.gather(*(speak(engine, t, s) for t, s in specs))
        alone = [await speak(engine, t, s) for t, s in specs]
        return together, alone

    together, alone = asyncio.run(main())
    for (_, ev_together), (_, ev_alone), (_, s) in zip(together, alone, specs, strict=True):
        a, b = codes_of(ev_together), codes_of(ev_alone)
        assert a.shape[0] == s.max_frames and np.array_equal(a, b)
    assert not np.array_equal(codes_of(together[0][1]), codes_of(together[2][1]))  # seeds matter


def test_streamed_text_equals_whole_text(engine):
    async def main():
        whole = await speak(engine)
        streamed = await speak(engine, words_delay=0.03, rng=random.Random(1))
        return whole, streamed

    (_, whole), (_, streamed) = asyncio.run(main())
    assert codes_of(whole).shape[0] == 16
    assert np.array_equal(codes_of(whole), codes_of(streamed))


@pytest.mark.parametrize("ramp", [(1, 2, 4, 8, 12), (1,), (3, 5), (12,)])
def test_streamed_audio_equals_whole_decode(tiny_model, ramp):
    engine = make_engine(tiny_model, chunk_ramp=ramp)
    try:
        _, events = asyncio.run(speak(engine, sampling=GREEDY.with_overrides(max_frames=29)))
    finally:
        engine.stop()
    codes = codes_of(events)
    starts = [e.start_sample for e in events if isinstance(e, AudioChunk)]
    sizes = [len(e.pcm) for e in events if isinstance(e, AudioChunk)]
    assert starts == list(np.cumsum([0] + sizes[:-1]))  # one gapless timeline
    with torch.inference_mode():
        whole = tiny_model.codec(torch.from_numpy(codes).T[None].to(tiny_model.device)).flatten().cpu().numpy()
    assert np.abs(pcm_of(events) - whole).max() < 1e-5


def test_segments_share_one_timeline_and_reseed(engine):
    seg_a, seg_b = TEXT[:5], TEXT[5:11]
    sampling = SamplingParams(seed=77, max_frames=10)

    async def main():
        both = await speak(engine, segments=[seg_a, seg_b], sampling=sampling)
        first = await speak(engine, seg_a, sampling)
        second = await speak(engine, seg_b, sampling.with_overrides(seed=78))
        return both, first, second

    (_, both), (_, first), (_, second) = asyncio.run(main())
    assert np.array_equal(codes_of(both, 0), codes_of(first))
    assert np.array_equal(codes_of(both, 1), codes_of(second))
    done = [e for e in both if isinstance(e, SegmentDone)]
    assert [d.segment for d in done] == [0, 1]
    seg1_first_chunk = next(e for e in both if isinstance(e, AudioChunk) and e.segment == 1)
    assert seg1_first_chunk.start_sample == done[0].end_sample == 10 * 1920
    assert isinstance(both[-1], ContextDone) and both[-1].audio_samples == 20 * 1920


def test_lengths_min_max_and_benchmark_mode(tiny_model):
    engine = make_engine(tiny_model, bench_frames_per_word=3)
    try:
        async def main():
            ctx = engine.open_context(ContextSpec(voice="ryan", sampling=SamplingParams(seed=1, max_frames=50)))
            ctx.append_text(TEXT[:6])
            await asyncio.sleep(0.3)  # while the text is open, the end of speech is masked
            ctx.close(words=4)
            return [ev async for ev in ctx.events()]

        events = asyncio.run(main())
    finally:
        engine.stop()
    assert codes_of(events).shape[0] == 12  # exactly 3 frames x 4 words
    assert events[-1].reason == "completed"
    engine = make_engine(tiny_model)
    try:
        _, events = asyncio.run(speak(engine, sampling=GREEDY.with_overrides(max_frames=5)))
    finally:
        engine.stop()
    assert codes_of(events).shape[0] == 5 and events[-1].reason == "max_frames"


def test_cancel_stops_the_context_and_frees_everything(engine):
    async def main():
        ctx = engine.open_context(ContextSpec(voice="vivian", sampling=GREEDY.with_overrides(max_frames=60)))
        ctx.append_text(TEXT)
        got = []
        async for ev in ctx.events():
            got.append(ev)
            if isinstance(ev, AudioChunk) and len(got) == 2:
                ctx.cancel()
        return got

    events = asyncio.run(main())
    assert isinstance(events[-1], ContextDone) and events[-1].reason == "cancelled"
    assert codes_of(events).shape[0] < 60
    stats = engine.stats()
    assert stats.contexts == 0 and stats.requests == 0 and stats.free_slots == 20


def test_a_failing_context_never_hurts_its_siblings(engine):
    async def main():
        good = asyncio.ensure_future(speak(engine))
        ctxs = []
        for kind in ("exception", "nan"):
            ctx = engine.open_context(ContextSpec(voice="ryan", sampling=GREEDY))
            ctx.inject_fault(kind, at_frame=3)
            ctx.append_text(TEXT)
            ctx.close()
            ctxs.append(ctx)
        bad = [await _collect(c) for c in ctxs]
        alone = await speak(engine)
        return await good, bad, alone

    (_, good), bad, (_, alone) = asyncio.run(main())
    for events in bad:
        assert events[-1].reason == "error" and events[-1].error_code == "synthesis_failed"
        assert "injected" in events[-1].error_message or "non-finite" in events[-1].error_message
    assert np.array_equal(codes_of(good), codes_of(alone)) and codes_of(good).shape[0] == 16


def test_admission_refuses_when_slots_run_out(tiny_model):
    engine = make_engine(tiny_model, max_slots=2)
    try:
        async def main():
            a = engine.open_context(ContextSpec(voice="ryan", sampling=GREEDY))
            b = engine.open_context(ContextSpec(voice="ryan", sampling=GREEDY))
            with pytest.raises(Overloaded) as err:
                engine.open_context(ContextSpec(voice="ryan", sampling=GREEDY))
            assert err.value.retryable and err.value.code == "overloaded"
            a.cancel(), b.cancel()
            [ev async for ev in a.events()], [ev async for ev in b.events()]
            engine.open_context(ContextSpec(voice="ryan", sampling=GREEDY)).cancel()  # a refused context never existed

        asyncio.run(main())
    finally:
        engine.stop()


def test_random_operations_leave_nothing_behind(tiny_model):
    engine = make_engine(tiny_model, max_slots=12)
    rng = random.Random(5)

    async def main():
        live, drains = [], []
        for _ in range(1000):
            op = rng.random()
            if op < 0.15 and len(live) < 10:
                try:
                    ctx = engine.open_context(ContextSpec(voice="aiden", sampling=SamplingParams(
                        seed=rng.randint(0, 99), max_frames=rng.randint(1, 4), min_frames=0)))
                except Overloaded:  # closed contexts still finishing hold their slots: a typed refusal
                    continue
                live.append(ctx)
                drains.append(asyncio.ensure_future(_drain(ctx)))
            elif live:
                ctx = rng.choice(live)
                kind = rng.random()
                try:
                    if kind < 0.4:
                        ctx.append_text(TEXT[: rng.randint(0, 4)])
                    elif kind < 0.55:
                        ctx.flush(words=1)
                    elif kind < 0.7:
                        ctx.report_playback(rng.random() * 500, rng.choice(["playing", "buffering", "underrun"]))
                    elif kind < 0.85:
                        ctx.close(words=1)
                        live.remove(ctx)
                    else:
                        ctx.cancel()
                        live.remove(ctx)
                except Exception as exc:  # only the protocol's typed errors are allowed
                    assert type(exc).__name__ == "ContextClosed", exc
            if rng.random() < 0.05:
                await asyncio.sleep(0.001)
        for ctx in live:
            ctx.close(words=1)
        ends = await asyncio.wait_for(asyncio.gather(*drains), timeout=120)
        return ends

    try:
        ends = asyncio.run(main())
        stats = engine.stats()
    finally:
        engine.stop()
    assert all(isinstance(e, ContextDone) for e in ends)
    assert stats.contexts == 0 and stats.requests == 0 and stats.open_contexts == 0
    assert stats.free_slots == 12 and stats.waiting_first_audio == 0
    assert not engine.runner.faults


async def _collect(ctx):
    return [ev async for ev in ctx.events()]


async def _drain(ctx):
    last = None
    async for ev in ctx.events():
        last = ev
    return last


@pytest.mark.parametrize("ramp", [(1, 2, 4, 8, 12), (3, 5)])
def test_graph_bucketing_matches_eager(tiny_model, ramp):
    """The CUDA-graph path pads batches to buckets (scratch slot), prompts and attention spans to length buckets and
    final codec chunks to ramp sizes. Emulated without capture on the CPU, it must give the eager codes and audio."""
    def run(mode):
        engine = Engine(tiny_model, EngineConfig(scheduler=SchedulerConfig(max_slots=8, admission_load=1e6,
                                                                           chunk_ramp=ramp),
                                                 max_frames=40, max_prompt_tokens=100, cuda_graphs=mode))
        engine.warmup()
        engine.start()

        async def main():
            specs = [(TEXT[: 4 + i], GREEDY.with_overrides(max_frames=11 + 3 * i) if i % 2 else
                      SamplingParams(seed=i, max_frames=13 + i), "dual") for i in range(5)]
            # Whole-layout prompts of about 20, 40 and 80 positions: prefill graphs of 32 and 64 positions, and
            # beyond the largest bucket (64 under this prompt cap) the eager prefill.
            specs += [(list(range(3000, 3000 + n)), SamplingParams(seed=n, max_frames=9), "whole")
                      for n in (9, 30, 70)]
            return await asyncio.gather(*(speak(engine, t, s, layout=lay) for t, s, lay in specs))

        try:
            return asyncio.run(main()), engine.readiness()
        finally:
            engine.stop()

    on_gpu = tiny_model.device.type == "cuda"  # VOICELANE_TEST_DEVICE=cuda: real capture and replay
    eager, ready_eager = run("off")
    padded, ready_padded = run("on" if on_gpu else "emulate")
    assert ready_eager.cuda_graphs.enabled is False and "off" in ready_eager.cuda_graphs.reason
    assert ready_padded.cuda_graphs.mode == ("cuda" if on_gpu else "emulate")
    assert ready_padded.cuda_graphs.graphs > 0
    assert ready_padded.cuda_graphs.prefill_lengths == [1, 2, 4, 8, 16, 32, 64]
    for (_, a), (_, b) in zip(eager, padded, strict=True):
        assert np.array_equal(codes_of(a), codes_of(b))
        assert np.abs(pcm_of(a) - pcm_of(b)).max() < 1e-5


def run_staggered(tiny_model, gap_s: float, pairs: bool = False, broken: bool = False, **sched):
    """Six contexts (greedy and seeded; with `pairs`, two at a time and every third in the whole layout) arriving
    gap_s apart on an engine with these scheduler settings, graphs captured on a GPU and emulated on the CPU; with
    `broken`, a seventh whose prefill raises. Returns (the six (context, events), the broken one's events or None,
    the engine) after the engine stopped."""
    on_gpu = tiny_model.device.type == "cuda"
    engine = Engine(tiny_model, EngineConfig(
        scheduler=SchedulerConfig(max_slots=8, admission_load=1e6, admission_first_audio_s=0, **sched),
        max_frames=40, max_prompt_tokens=100, cuda_graphs="on" if on_gpu else "emulate"))
    engine.warmup()
    engine.start()

    async def one(i: int):
        await asyncio.sleep(gap_s * (i // 2 if pairs else i))
        sampling = GREEDY.with_overrides(max_frames=12 + 2 * i) if i % 2 else SamplingParams(seed=i, max_frames=14)
        return await speak(engine, TEXT[: 4 + i], sampling, layout="whole" if pairs and i % 3 == 2 else "dual")

    async def failing():
        ctx = engine.open_context(ContextSpec(voice="ryan", sampling=GREEDY))
        ctx.inject_fault("exception", at_frame=0)  # raises in its prefill
        ctx.append_text(TEXT)
        ctx.close()
        return await _collect(ctx)

    async def main():
        return await asyncio.gather(*(one(i) for i in range(6)), *([failing()] if broken else []))

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    return results[:6], results[6] if broken else None, engine


def test_the_first_audio_lane_changes_when_steps_run_never_what_they_compute(tiny_model):
    """Two lanes (newcomers' steps on a stream of their own, with their own graphs) beside one: staggered contexts
    get the same codes and audio. On a GPU (VOICELANE_TEST_DEVICE=cuda) the lanes' graphs replay concurrently."""
    one_lane, _, engine_one = run_staggered(tiny_model, 0.03, first_audio_lane=False, first_lane_max_batch=2)
    two_lanes, _, engine_two = run_staggered(tiny_model, 0.03, first_audio_lane=True, first_lane_max_batch=2)
    ready_one, ready_two = engine_one.readiness(), engine_two.readiness()
    assert not ready_one.first_audio_lane.enabled and "off" in ready_one.first_audio_lane.reason
    assert ready_two.first_audio_lane.enabled and ready_two.first_audio_lane.batch_buckets == [1, 2]
    assert all(lane.launched > 0 for lane in engine_two.core.lanes)  # both lanes ran steps
    for (_, a), (_, b) in zip(one_lane, two_lanes, strict=True):
        assert np.array_equal(codes_of(a), codes_of(b))
        assert np.abs(pcm_of(a) - pcm_of(b)).max() < 1e-5


def test_the_first_audio_chain_runs_three_steps_as_one_and_changes_nothing_they_compute(tiny_model):
    """first_audio_chain: a segment's prefill, frame 0's codes and its first chunk run as one FIRST_AUDIO step.
    Contexts arriving in pairs (chained batches of two; dual and whole layouts, greedy and seeded) get the same
    codes and audio as with three steps; a context whose prefill fails takes no sibling of its chained batch down.
    On a GPU (VOICELANE_TEST_DEVICE=cuda) the three stages' graphs replay back to back. (max_step_s off: a CPU's
    chain is longer than a short step, which would turn chaining off.)"""
    three, failed_three, engine_three = run_staggered(tiny_model, 0.02, pairs=True, broken=True, max_step_s=0,
                                                      first_audio_chain=False, collect_first_audio_at_once=False)
    one, failed_one, engine_one = run_staggered(tiny_model, 0.02, pairs=True, broken=True, max_step_s=0,
                                                first_audio_chain=True)
    stages_three, stages_one = engine_three.stats().stages, engine_one.stats().stages
    chain_off, chain_on = engine_three.readiness().first_audio_chain, engine_one.readiness().first_audio_chain
    assert not chain_off.enabled and "off" in chain_off.reason and chain_on.enabled and chain_on.reason is None
    assert engine_one.readiness().to_json()["first_audio_chain"] == {"enabled": True}
    assert "first_audio" not in stages_three and stages_three["prefill"].steps > 0
    # six contexts, the broken one and the warm-up's two utterances
    assert "prefill" not in stages_one and stages_one["first_audio"].rows == 9
    for failed in (failed_three, failed_one):
        assert failed[-1].reason == "error" and "injected" in failed[-1].error_message
        assert not any(isinstance(e, AudioChunk) for e in failed)
    for (_, a), (_, b) in zip(three, one, strict=True):
        assert np.array_equal(codes_of(a), codes_of(b)) and len(codes_of(a)) >= 12
        assert np.abs(pcm_of(a) - pcm_of(b)).max() < 1e-5
        first = next(e for e in b if isinstance(e, AudioChunk))
        assert first.first_frame == 0 and len(first.codes) == 1  # the chain's chunk: frame 0 alone
        # where each part of the way to first audio ran (three steps or one): in order, each part taking time
        for times in (first.first_audio, next(e for e in a if isinstance(e, AudioChunk)).first_audio):
            assert times.prefill_planned <= times.prefill_started < times.prefill_done \
                < times.code_predictor_done < times.codec_done <= times.collected, times
    loop = engine_one.stats().loop  # the loop's accounting: device idle gaps are measured on a GPU only
    assert loop.iterations >= sum(v.steps for v in stages_one.values()) and loop.host_s > 0
    assert (loop.idle_gaps > 0) == (tiny_model.device.type == "cuda")


def test_a_dead_engine_loop_ends_every_context(tiny_model):
    """If the loop itself dies (a device failure), no client waits forever and new contexts are refused."""
    engine = make_engine(tiny_model)

    def broken_collect(pending):
        raise RuntimeError("device lost")

    try:
        async def main():
            ctx = engine.open_context(ContextSpec(voice="ryan", sampling=GREEDY))
            engine.runner.collect = broken_collect
            ctx.append_text(TEXT)
            events = await asyncio.wait_for(_collect(ctx), timeout=60)
            with pytest.raises(Exception) as err:
                engine.open_context(ContextSpec(voice="ryan", sampling=GREEDY))
            return events, err.value

        events, refused = asyncio.run(main())
    finally:
        engine.stop()
    assert events[-1].reason == "error" and events[-1].error_code == "internal"
    assert "device lost" in events[-1].error_message
    assert getattr(refused, "code", None) == "internal" and engine.readiness().engine_running is False


def test_whole_layout_text_longer_than_the_prompt_is_refused(tiny_model):
    engine = make_engine(tiny_model)  # max_prompt_tokens 96: 85 text tokens fit without an instruction
    try:
        async def main():
            ctx = engine.open_context(ContextSpec(voice="ryan", language="english", text_layout="whole",
                                                  sampling=GREEDY.with_overrides(max_frames=3)))
            ctx.append_text(list(range(1000, 1080)))
            with pytest.raises(Exception) as err:
                ctx.append_text(list(range(1000, 1010)))  # 90 > 85: refused, nothing appended
            ctx.append_text(list(range(1000, 1005)))  # 85 fits exactly
            ctx.close()
            return err.value, await _collect(ctx)

        err, events = asyncio.run(main())
    finally:
        engine.stop()
    assert getattr(err, "code", None) == "text_too_long" and err.param == "text"
    assert events[-1].reason == "max_frames" and codes_of(events).shape[0] == 3  # the prompt fit the KV cache


def test_debug_sync_refuses_out_of_range_state_row_by_row(tiny_model):
    """--debug-sync reads every index a step will use: a slot whose codes were corrupted fails with a message naming
    it, before any kernel could assert, and its batch siblings run on unharmed."""
    engine = Engine(tiny_model, EngineConfig(scheduler=SchedulerConfig(max_slots=6, admission_load=1e6),
                                             max_frames=64, max_prompt_tokens=96, debug_sync=True))
    engine.start()
    launch, corrupted = engine.runner.launch, []

    def corrupting_launch(plan):
        victim = [r for r in plan.rows if r.cid == bad_cid and plan.stage.value == "codec"]
        if victim and not corrupted:
            engine.runner.frames[victim[0].slot, :, 0] = 5000  # beyond the 2048-entry codebooks
            corrupted.append(victim[0].slot)
        return launch(plan)

    engine.runner.launch = corrupting_launch
    try:
        async def main():
            nonlocal bad_cid
            good = engine.open_context(ContextSpec(voice="ryan", sampling=GREEDY))
            bad = engine.open_context(ContextSpec(voice="ryan", sampling=GREEDY))
            bad_cid = bad.cid
            for ctx in (good, bad):
                ctx.append_text(TEXT)
                ctx.close()
            return await _collect(good), await _collect(bad)

        bad_cid = -1
        good_events, bad_events = asyncio.run(main())
    finally:
        engine.stop()
    assert corrupted
    assert bad_events[-1].reason == "error" and "codec step input out of range" in bad_events[-1].error_message
    assert f"slot {corrupted[0]}" in bad_events[-1].error_message
    assert good_events[-1].reason == "max_frames" and codes_of(good_events).shape[0] == 16


def test_a_step_is_timed_alone_not_with_what_ran_before_its_collect(tiny_model):
    """The cost model learns from each step's duration: the loop launches the next step before it collects this
    one, so the time between must not be charged to this step."""
    import time as _time

    from engine.runner import Runner
    from engine.types import RowPlan, Stage, StagePlan

    runner = Runner(tiny_model, EngineConfig(scheduler=SchedulerConfig(max_slots=2), max_frames=16,
                                             max_prompt_tokens=64))
    t0 = _time.monotonic()
    pending = runner.launch(StagePlan(Stage.CODEC, [RowPlan(0, 0, 0, 0, chunk=1)]))
    launch_s = _time.monotonic() - t0  # on the CPU, the launch runs the step; on a GPU it only queues it
    _time.sleep(0.5)  # the next step's launch, on the host
    result = runner.collect(pending)
    bound = launch_s if runner.device.type == "cpu" else 0.5  # GPU: the step's own device time, from events
    assert 0 < result.elapsed_s <= bound and result.failed == [None]


@pytest.mark.parametrize("mode", ["off", "emulate"])
def test_a_codec_step_of_mixed_chunks_gives_each_row_its_own_audio(tiny_model, mode):
    """Rows of different chunk sizes in one codec step (padded to the largest; emulated graphs: to a ramp size too,
    with a scratch row padding the batch) each get their own chunk's codes and exactly the audio the same steps
    give that row alone (to float rounding: batches of other sizes), which is its frames' whole decode."""
    from engine.runner import Runner
    from engine.types import RowPlan, Stage, StagePlan

    def runner():
        return Runner(tiny_model, EngineConfig(scheduler=SchedulerConfig(max_slots=4, chunk_ramp=(1, 2, 4, 12)),
                                               max_frames=48, max_prompt_tokens=64, cuda_graphs=mode))

    slots = [0, 2, 3]
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, tiny_model.codec.config.codebook_size, (3, 48, 16), generator=g)
    # chunks per step and row (0: the row sits the step out); 3 and 5 are final chunks off the ramp
    schedule = [(1, 1, 0), (2, 1, 1), (4, 12, 1), (12, 2, 4), (1, 4, 12), (12, 12, 2), (0, 12, 12), (5, 3, 12)]

    def play(rows_together: bool):
        r = runner()
        r.frames[slots, :48] = codes.to(r.device)
        done, pcm = [0, 0, 0], [[], [], []]
        for chunks in schedule:
            plans = [RowPlan(i, i, slots[i], done[i], chunk=c) for i, c in enumerate(chunks) if c]
            for plan in [plans] if rows_together else [[p] for p in plans]:
                result = r.collect(r.launch(StagePlan(Stage.CODEC, plan)))
                assert result.failed == [None] * len(plan)
                for p, audio, frames in zip(plan, result.pcm, result.codes, strict=True):
                    assert len(audio) == p.chunk * 1920
                    assert np.array_equal(frames, codes[p.rid, p.frame:p.frame + p.chunk].numpy())
                    pcm[p.rid].append(audio)
                    done[p.rid] += p.chunk
        return [np.concatenate(x) for x in pcm], done

    together, done = play(True)
    alone, _ = play(False)
    for i in range(3):
        assert np.abs(together[i] - alone[i]).max() < 1e-5
        with torch.inference_mode():
            whole = tiny_model.codec(codes[i, :done[i]].T[None].to(tiny_model.device)).flatten().cpu().numpy()
        assert np.abs(together[i] - whole).max() < 1e-5


class _FakeEvent:
    """A CUDA event as DeviceClock reads it: when it completed on the device's clock (seconds)."""

    def __init__(self, device_s: float):
        self.device_s = device_s

    def elapsed_time(self, other: _FakeEvent) -> float:  # ms, as torch.cuda.Event's
        return (other.device_s - self.device_s) * 1e3


def test_device_events_map_to_the_host_clock_through_the_last_one_waited_for():
    """A chain's parts, timed by events on the device's clock (offset by 1000 s from the host's here), come back as
    host times through the anchor, and the work queued ahead of it maps too; an event found already complete does
    not replace an anchor, one waited for does."""
    from types import SimpleNamespace

    from engine.runner import DeviceClock, Pending, Runner
    from engine.types import Stage, StagePlan

    clock = DeviceClock()
    end = _FakeEvent(1005.0090)
    clock.saw(_FakeEvent(1000.0), 0.0, waited=False)  # no anchor yet: taken, even though found complete
    clock.saw(end, 5.0091, waited=True)  # the host waited and saw it complete: 100 us of wake-up
    clock.saw(_FakeEvent(1002.0), 99.0, waited=False)  # complete long before this look: not an anchor
    pending = Pending(StagePlan(Stage.FIRST_AUDIO, []), started=5.0, start_event=_FakeEvent(1005.0010),
                      end_event=end, ahead=_FakeEvent(1005.0005),
                      marks=[("prefill", _FakeEvent(1005.0030)), ("code_predictor", _FakeEvent(1005.0060))])
    spans, ahead = Runner._device_spans(SimpleNamespace(device_clock=clock), pending)
    assert list(spans) == ["prefill", "code_predictor", "codec"]
    expected = {"prefill": (5.0011, 5.0031), "code_predictor": (5.0031, 5.0061), "codec": (5.0061, 5.0091)}
    for stage, (start, stop) in expected.items():
        assert spans[stage] == (pytest.approx(start, abs=1e-9), pytest.approx(stop, abs=1e-9)), stage
    assert ahead == pytest.approx(5.0006, abs=1e-9)
    # a one-stage step: one span, named by its stage
    single = Pending(StagePlan(Stage.TALKER, []), started=5.0, start_event=_FakeEvent(1005.0010), end_event=end)
    spans, ahead = Runner._device_spans(SimpleNamespace(device_clock=clock), single)
    assert list(spans) == ["talker"] and ahead is None
