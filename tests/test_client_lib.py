"""The async Python client (voicelane_client/client.py) against a live server."""

from __future__ import annotations

import asyncio

import pytest
from live_server import live_server, run

from voicelane_client import (
    AudioPacket,
    ContextCancelled,
    ContextDone,
    Flushed,
    VoicelaneClient,
    VoicelaneError,
    decode_opus,
    decode_pcm,
)


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    return live_server(tiny_checkpoint, "default")


async def llm_tokens(text: str):
    """A fake LLM stream: word pieces with their spaces, a little apart."""
    for i, word in enumerate(text.split(" ")):
        yield word if i == 0 else " " + word
        await asyncio.sleep(0.005)


def test_speak_stream_and_decode(server):
    async def go():
        async with await VoicelaneClient.connect(server.ws_url) as client:
            assert client.session["protocol"] == "voicelane/1"
            ctx = await client.create_context(output_format="opus_48000_32", sampling={"seed": 4})
            assert ctx.seed == 4 and ctx.pre_skip == 312 and ctx.stream_id
            await ctx.speak(llm_tokens("Hello there, this is the client speaking."))
            u = await ctx.collect()
            assert u.done is not None and u.done.reason == "completed" and u.done.ttfa_ms > 0
            assert [p.seq for p in u.packets] == list(range(len(u.packets)))
            assert u.packets[0].first and u.packets[-1].last
            pcm = decode_opus(u.packets, ctx.pre_skip)
            assert len(pcm) / 48 >= u.done.audio_ms
            assert u.done.raw["frames"] == 2 * 7

    run(go())


def test_flush_cancel_and_implicit_contexts(server):
    async def go():
        client = await VoicelaneClient.connect(server.ws_url)
        ctx = client.context("implicit")
        await ctx.send_text("First part.", flush=True, flush_id="p1")
        await ctx.send_text(" Second part")
        await ctx.close()
        events = [ev async for ev in ctx.events(timeout=60)]
        assert ctx.created is not None and ctx.created["context_id"] == "implicit"
        flushed = [e for e in events if isinstance(e, Flushed)]
        assert [f.flush_id for f in flushed] == ["p1"]
        assert isinstance(events[-1], ContextDone)
        pcm = decode_pcm([e for e in events if isinstance(e, AudioPacket)], "pcm_s16le")
        assert len(pcm) / 24 == pytest.approx(events[-1].audio_ms, abs=0.1)
        # barge-in
        long = await client.create_context(max_frames=60)
        await long.speak("word " * 30)
        first = await long.next_event(60)
        assert isinstance(first, AudioPacket)
        await long.cancel(played_ms=12)
        rest = [ev async for ev in long.events(timeout=60)]
        assert isinstance(rest[-1], ContextCancelled) and rest[-1].played_ms == 12
        # errors: a refused context raises; the session goes on
        with pytest.raises(VoicelaneError) as e:
            await client.create_context(voice="nobody")
        assert e.value.code == "unknown_voice" and not e.value.fatal
        assert await client.ping() > 0
        defaults = await client.update_session({"voice": "vivian"})
        assert defaults["voice"] == "vivian"
        assert await client.close() == 1000

    run(go())


def test_auth_modes(tiny_checkpoint):
    strict = live_server(tiny_checkpoint, "strict")

    async def go():
        for auth in ("header", "query", "subprotocol"):
            client = await VoicelaneClient.connect(strict.ws_url, api_key="key-one", auth=auth)
            await client.aclose()
        with pytest.raises(VoicelaneError) as e:
            await VoicelaneClient.connect(strict.ws_url, api_key="wrong")
        assert e.value.code == "unauthorized" and e.value.fatal and e.value.close_code == 4001

    run(go())
