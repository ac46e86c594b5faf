"""The engine in a process of its own (engine/remote.py, `--engine-process on`) on the CPU with the tiny checkpoint:
it speaks as the engine in this process does, its errors keep their types, a fault stays in its context, segment
numbers match the scheduler's, and a dead engine process ends every open context instead of hanging it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import numpy as np
import pytest

from engine import EngineContext
from engine.api import ContextSpec, InvalidRequest, Overloaded
from engine.config import EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.remote import EngineProcessError, RemoteEngine
from engine.types import AudioChunk, ContextDone, SegmentDone
from server.cli import engine_process_main
from server.config import ServerConfig
from tests.test_engine import GREEDY, TEXT, codes_of, pcm_of

SEEDED = GREEDY.with_overrides(temperature=0.9, sub_temperature=0.9, top_k=50, seed=7, max_frames=12)


def engine_config(max_slots: int = 8) -> EngineConfig:
    sched = SchedulerConfig(max_slots=max_slots, admission_load=1e6, admission_first_audio_s=0)
    return EngineConfig(scheduler=sched, max_frames=64, max_prompt_tokens=96)


def spawn(checkpoint, max_slots: int = 8) -> RemoteEngine:
    cfg = ServerConfig(model=str(checkpoint), device="cpu", dtype="float32", cpu_threads=2, warmup=False,
                       log_level="warning", engine=engine_config(max_slots))
    return RemoteEngine.spawn(engine_process_main, cfg, start_timeout_s=300)


@pytest.fixture(scope="module")
def remote(tiny_checkpoint):
    engine = spawn(tiny_checkpoint)
    yield engine
    engine.stop()


def spec(sampling=GREEDY, voice="ryan") -> ContextSpec:
    return ContextSpec(voice=voice, language="english", sampling=sampling)


async def say(engine, sampling, segments: list[list[int]]) -> tuple[EngineContext, list, list]:
    """Each segment flushed, then close; returns the context, what flush/close returned, and every event."""
    ctx = engine.open_context(spec(sampling))
    returned = []
    for ids in segments:
        if ids:
            ctx.append_text(ids)
        returned.append(ctx.flush(words=len(ids)))
    returned.append(ctx.close())
    return ctx, returned, [ev async for ev in ctx.events()]


def test_it_speaks_as_the_engine_in_this_process(remote, tiny_model):
    cases = [(GREEDY, [TEXT]), (SEEDED, [TEXT[:5], TEXT[5:]])]

    async def run(engine):
        return [await say(engine, s, segs) for s, segs in cases]

    remote_out = asyncio.run(run(remote))
    local = Engine(tiny_model, engine_config())
    local.start()
    try:
        local_out = asyncio.run(run(local))
    finally:
        local.stop()
    for (_, r_ret, r_events), (_, l_ret, l_events) in zip(remote_out, local_out, strict=True):
        assert r_ret == l_ret
        assert len(codes_of(r_events)) > 0
        np.testing.assert_array_equal(codes_of(r_events), codes_of(l_events))
        np.testing.assert_allclose(pcm_of(r_events), pcm_of(l_events), atol=1e-5)
        assert [type(e).__name__ for e in r_events] == [type(e).__name__ for e in l_events]
        assert r_events[-1].reason == l_events[-1].reason == "max_frames"  # random weights never say EOS


def test_segment_numbers_match_the_schedulers(remote):
    """An empty flush is no segment: the numbers handed back are the SegmentDone numbers that arrive."""
    _, returned, events = asyncio.run(say(remote, GREEDY, [TEXT[:4], [], TEXT[4:8]]))
    assert returned == [0, None, 1, None]
    assert [e.segment for e in events if isinstance(e, SegmentDone)] == [0, 1]


def test_typed_errors_cross_the_process_boundary(remote, tiny_checkpoint):
    async def bad_voice():
        remote.open_context(spec(voice="nobody"))

    with pytest.raises(InvalidRequest) as caught:
        asyncio.run(bad_voice())
    assert caught.value.code == "unknown_voice" and caught.value.param == "voice"

    one_slot = spawn(tiny_checkpoint, max_slots=1)
    try:
        async def two():
            first = one_slot.open_context(spec())
            with pytest.raises(Overloaded, match="slots"):
                one_slot.open_context(spec())
            first.cancel()
            return [ev async for ev in first.events()]

        events = asyncio.run(two())
        assert isinstance(events[-1], ContextDone) and events[-1].reason == "cancelled"
    finally:
        one_slot.stop()


async def within(ctx: EngineContext, seconds: float = 120.0) -> list:
    """Every event of a context, or a failure (not a hung test) if its end does not come."""
    async def collect():
        return [ev async for ev in ctx.events()]

    return await asyncio.wait_for(collect(), seconds)


def test_a_pipelined_open_speaks_as_a_called_one_and_a_refusal_is_its_first_event(remote, tiny_checkpoint):
    """open_context_pipelined: the open, the text and the close leave together; the codes are the called open's. A
    refused one (an unknown voice here; no slot below) ends with ContextDone("refused") carrying the error's code and
    field, the text sent to it meanwhile is dropped, and the engine goes on serving."""
    async def main(engine):
        called = engine.open_context(spec())
        piped = engine.open_context_pipelined(spec())
        refused = engine.open_context_pipelined(spec(voice="nobody"))
        for ctx in (called, piped, refused):
            ctx.append_text(TEXT)
            ctx.close()
        return [await within(ctx) for ctx in (called, piped, refused)]

    called, piped, refused = asyncio.run(main(remote))
    assert len(codes_of(piped)) == GREEDY.max_frames
    np.testing.assert_array_equal(codes_of(piped), codes_of(called))
    assert len(refused) == 1 and refused[0].reason == "refused"
    assert (refused[0].error_code, refused[0].error_param) == ("unknown_voice", "voice")
    assert "nobody" in refused[0].error_message

    one_slot = spawn(tiny_checkpoint, max_slots=1)
    try:
        async def two():
            first = one_slot.open_context_pipelined(spec())
            second = one_slot.open_context_pipelined(spec())
            second.append_text(TEXT)
            second.close()
            second_events = await within(second)
            first.append_text(TEXT)
            first.close()
            return await within(first), second_events

        first, second = asyncio.run(two())
        assert [ev.reason for ev in second] == ["refused"] and second[0].error_code == "overloaded"
        assert "slots" in second[0].error_message
        assert first[-1].reason == "max_frames" and len(codes_of(first)) == GREEDY.max_frames
    finally:
        one_slot.stop()


class CountingPipe:
    """The commands pipe's send, counted (each send is one write)."""

    def __init__(self, pipe):
        self.pipe, self.sent = pipe, []

    def send(self, message) -> None:
        self.sent.append(message)
        self.pipe.send(message)


def test_coalesced_commands_leave_in_one_write_and_speak_as_sent_one_by_one(remote):
    """Inside coalesced(), a pipelined open, its text and its close are one write; the codes are those of the same
    commands sent one by one; a call inside it sends what came before first (its answer needs them), and a refused
    open in the batch does not stop the commands after it."""
    real, counting = remote._commands, CountingPipe(remote._commands)

    async def main(engine):
        separate = engine.open_context_pipelined(spec())
        separate.append_text(TEXT)
        separate.close()
        writes_before = len(counting.sent)
        with engine.coalesced():
            refused = engine.open_context_pipelined(spec(voice="nobody"))
            refused.append_text(TEXT)
            together = engine.open_context_pipelined(spec())
            together.append_text(TEXT)
            together.close()
            assert len(counting.sent) == writes_before  # nothing left yet
        one_write = counting.sent[writes_before:]
        writes_before = len(counting.sent)
        with engine.coalesced():
            held = engine.open_context_pipelined(spec())
            called = engine.open_context(spec())  # a call: the held open leaves first, then the call
            for ctx in (held, called):
                ctx.append_text(TEXT)
                ctx.close()
        around_call = counting.sent[writes_before:]
        return [await within(ctx) for ctx in (separate, refused, together, held, called)], one_write, around_call

    remote._commands = counting
    try:
        (separate, refused, together, held, called), one_write, around_call = asyncio.run(main(remote))
    finally:
        remote._commands = real
    assert len(one_write) == 1 and one_write[0][0] == "batch"
    assert [m[0] for m in one_write[0][1]] == ["open", "op", "open", "op", "op"]
    # the held open left before the call, alone; the rest together after it
    assert [m[0] for m in around_call] == ["open", "call", "batch"]
    assert [m[0] for m in around_call[2][1]] == ["op"] * 4
    assert [ev.reason for ev in refused] == ["refused"]
    assert len(codes_of(together)) == GREEDY.max_frames
    for ctx_events in (together, held, called):
        np.testing.assert_array_equal(codes_of(ctx_events), codes_of(separate))


def test_a_fault_stays_in_its_context(remote):
    async def main():
        broken = remote.open_context(spec())
        broken.inject_fault("exception", at_frame=2)
        sibling = remote.open_context(spec())
        for ctx in (broken, sibling):
            ctx.append_text(TEXT)
            ctx.close()
        return [ev async for ev in broken.events()], [ev async for ev in sibling.events()]

    broken, sibling = asyncio.run(main())
    assert broken[-1].reason == "error" and broken[-1].error_code == "synthesis_failed"
    assert sibling[-1].reason == "max_frames" and len(codes_of(sibling)) == GREEDY.max_frames


def test_barge_in_stops_the_stream(remote):
    async def main():
        ctx = remote.open_context(spec(GREEDY.with_overrides(max_frames=64)))
        ctx.append_text(TEXT)
        events = []
        async for ev in ctx.events():
            events.append(ev)
            if isinstance(ev, AudioChunk):
                ctx.cancel()
        return events

    events = asyncio.run(main())
    assert events[-1].reason == "cancelled"
    assert sum(len(e.codes) for e in events if isinstance(e, AudioChunk)) < 64


def test_a_dead_engine_process_ends_every_open_context(tiny_checkpoint):
    engine = spawn(tiny_checkpoint)
    try:
        async def main():
            ctx = engine.open_context(spec(GREEDY.with_overrides(max_frames=64)))
            ctx.append_text(TEXT)
            events = ctx.events()
            first = await anext(events)  # it is speaking
            os.kill(engine.pid, signal.SIGKILL)
            rest = [ev async for ev in events]
            return first, rest

        first, rest = asyncio.run(asyncio.wait_for(main(), 60))
        assert isinstance(first, (AudioChunk, SegmentDone))
        done = rest[-1]
        assert isinstance(done, ContextDone) and done.reason == "error" and done.error_code == "internal"
        assert "engine process exited" in done.error_message
        assert not engine.running()
        ready = engine.readiness()
        assert not ready.engine_running and not ready.engine_process.enabled

        async def another():
            engine.open_context(spec())

        with pytest.raises(EngineProcessError):
            asyncio.run(another())
    finally:
        engine.stop()


def test_readiness_names_the_engine_process(remote):
    ready = remote.readiness()
    assert ready.engine_running and ready.engine_process.enabled
    assert ready.engine_process.mode == f"process {remote.pid}" and remote.pid != os.getpid()
    assert remote.stats().max_slots == 8
    assert "traceEvents" in json.loads(remote.chrome_trace())


def test_frames_cross_in_pieces_under_uvloop(tiny_checkpoint, remote, monkeypatch):
    """The server's loop reads the events pipe without blocking (uvloop makes the descriptor non-blocking whatever
    we ask), so a delivery larger than the pipe arrives in pieces. On the H200, Connection.recv on that descriptor
    raised BlockingIOError at 20 RPS, read as the engine process's death: every request after it failed. Here the
    pipe holds 4 KiB, so every audio chunk arrives in pieces, and eight streams run at once."""
    uvloop = pytest.importorskip("uvloop")
    import engine.remote

    async def together(engine):
        async def one(i):
            return (await say(engine, GREEDY.with_overrides(max_frames=24), [TEXT[: 4 + i]]))[2]

        return await asyncio.gather(*(one(i) for i in range(8)))

    reference = asyncio.run(together(remote))
    monkeypatch.setattr(engine.remote, "PIPE_BYTES", 4096)
    small = spawn(tiny_checkpoint)
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            pieces = runner.run(together(small))
    finally:
        small.stop()
    for got, want in zip(pieces, reference, strict=True):
        assert got[-1].reason == want[-1].reason == "max_frames"
        np.testing.assert_array_equal(codes_of(got), codes_of(want))
        np.testing.assert_allclose(pcm_of(got), pcm_of(want), atol=1e-5)


def test_stop_is_prompt_while_the_engine_thread_waits_on_a_full_pipe(tiny_checkpoint, monkeypatch):
    """On the H200 the server's stop waited 10 s and killed the engine process: its engine thread was blocked
    writing into a pipe nobody read any more. Closing our end first fails that write, and the process exits."""
    import engine.remote

    monkeypatch.setattr(engine.remote, "PIPE_BYTES", 4096)
    engine_ = spawn(tiny_checkpoint)

    async def start_and_leave():
        for _ in range(4):
            ctx = engine_.open_context(spec(GREEDY.with_overrides(max_frames=64)))
            ctx.append_text(TEXT)
            ctx.close()
        await asyncio.sleep(1.0)  # the loop reads while it runs; then nobody reads

    asyncio.run(start_and_leave())
    time.sleep(1.0)  # the engine fills the 4 KiB pipe and blocks
    t0 = time.monotonic()
    engine_.stop()
    assert time.monotonic() - t0 < 5.0 and engine_.process.exitcode == 0


def test_a_start_up_failure_is_reported_with_its_cause(tmp_path):
    cfg = ServerConfig(model=str(tmp_path / "no-such-checkpoint"), device="cpu", warmup=False, log_level="error",
                       engine=engine_config())
    t0 = time.monotonic()
    with pytest.raises(EngineProcessError, match="failed to start.*no-such-checkpoint"):
        RemoteEngine.spawn(engine_process_main, cfg, start_timeout_s=120)
    assert time.monotonic() - t0 < 60


def test_an_engine_process_that_stops_answering_is_given_up(tiny_checkpoint, monkeypatch):
    """A reply that came after its call had timed out would be read as the next call's answer: instead, the first
    call without an answer ends the engine's service (every context ends; /health would say so)."""
    import engine.remote

    engine_ = spawn(tiny_checkpoint)
    try:
        os.kill(engine_.pid, signal.SIGSTOP)  # alive, silent
        monkeypatch.setattr(engine.remote, "CALL_TIMEOUT_S", 0.5)

        async def main():
            with pytest.raises(EngineProcessError, match="did not answer open_context"):
                engine_.open_context(spec())
            with pytest.raises(EngineProcessError, match="has stopped"):
                engine_.open_context(spec())

        asyncio.run(main())
        assert not engine_.running() and not engine_.readiness().engine_running
    finally:
        os.kill(engine_.pid, signal.SIGCONT)
        engine_.stop()
