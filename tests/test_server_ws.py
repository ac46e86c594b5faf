"""WebSocket protocol (docs/protocol.md 1) against a live server on the CPU with the tiny checkpoint.

The server runs in benchmark length mode with 2 frames per word, so every segment's length is known exactly:
frames = 2 x words (docs/protocol.md 1.6)."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import opuslib
import pytest
from live_server import Raw, collect, live_server, run, speak_ctx

FPW = 2  # --bench-frames-per-word of the "default" server
FRAME = 1920  # samples per frame at 24 kHz


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    return live_server(tiny_checkpoint, "default")


def words(n: int, stem: str = "word") -> list[str]:
    return [f"{stem}{chr(97 + i % 26)} " for i in range(n)]


def test_session_created(server):
    async def go():
        raw = await Raw.open(server.ws_url)
        s = raw.session
        assert raw.ws.subprotocol == "voicelane.v1"
        assert s["protocol"] == "voicelane/1" and s["session_id"] and s["model"]
        assert set(s["limits"]) == {"max_contexts", "max_text_chars_per_message", "max_text_chars_per_context",
                                    "max_message_bytes", "max_frames", "idle_timeout_s", "context_idle_timeout_s",
                                    "max_unsent_audio_s", "max_unsent_bytes", "max_messages_per_s"}
        assert s["limits"]["max_contexts"] == 8 and s["limits"]["max_message_bytes"] == 65536
        assert s["limits"]["max_frames"] == 64
        d = s["defaults"]
        assert set(d) == {"voice", "language", "output_format", "audio_transport", "text_layout",
                          "text_normalization", "sampling"}
        assert d["output_format"] == {"encoding": "pcm_s16le", "sample_rate": 24000, "channels": 1}
        assert (d["audio_transport"], d["text_layout"], d["text_normalization"]) == ("binary", "dual", "llm")
        assert set(d["sampling"]) >= {"temperature", "top_k", "top_p", "repetition_penalty", "subtalker"}
        assert {v["name"] for v in s["voices"]} >= {"ryan", "vivian", "uncle_fu", "eric", "dylan"}
        assert "auto" in s["languages"] and "english" in s["languages"]
        assert s["bench_frames_per_word"] == FPW
        await raw.close()

    run(go())


def test_opus_word_by_word(server):
    """Binary Opus packets: header fields, ordering, flags, and decoded durations that match the frames made."""

    async def go():
        raw = await Raw.open(server.ws_url)
        text = words(6)
        created = await speak_ctx(raw, "op", [], create={"output_format": "opus_48000_32",
                                                          "sampling": {"seed": 11}}, close=False, event_id="e1")
        assert created["event_id"] == "e1" and created["seed"] == 11 and created["trace_id"]
        assert created["output_format"]["encoding"] == "opus"
        assert created["opus"] == {"pre_skip": 312, "input_sample_rate": 24000}
        for w in text:
            await raw.send({"type": "text", "context_id": "op", "text": w})
            await asyncio.sleep(0.01)
        await raw.send({"type": "context.close", "context_id": "op"})
        got = await collect(raw, "op", created["stream_id"])
        done, packets = got["end"], got["packets"]
        assert done["type"] == "context.done" and done["reason"] == "completed"
        assert done["frames"] == FPW * len(text)
        assert [p["seq"] for p in packets] == list(range(len(packets)))
        assert all(p["start_sample"] == i * 960 for i, p in enumerate(packets))  # 20 ms packets, 48 kHz clock
        flags = [p["flags"] for p in packets]
        assert flags[0] & 1 and flags[0] & 4 and not any(f & 1 for f in flags[1:])
        assert flags[-1] & 2 and not any(f & 2 for f in flags[:-1])
        dec = opuslib.Decoder(48000, 1)
        pcm = np.concatenate([np.frombuffer(dec.decode(p["payload"], 5760), "<i2") for p in packets
                              if p["payload"]])[312:]
        real = (done["frames"] * FRAME * 1000 / 24000 - done["trimmed_ms"])  # ms of kept model audio
        assert done["audio_ms"] == pytest.approx(real, abs=0.05)
        padding_ms = len(pcm) / 48 - real  # the encoder's flush pads the last packet
        assert 0 <= padding_ms <= 26.5
        assert np.abs(pcm[: int(real * 48)]).max() > 100  # random weights: loud noise, not silence
        assert done["ttfa_ms"] is not None and done["ttfa_ms"] > 0
        await raw.close()

    run(go())


def test_flush_segments_and_flush_ids(server):
    async def go():
        raw = await Raw.open(server.ws_url)
        created = await speak_ctx(raw, "f", [], close=False)
        await raw.send({"type": "flush", "context_id": "f", "flush_id": "nothing-yet"})  # no text at all: at once
        await raw.send({"type": "text", "context_id": "f", "text": "one two three", "flush": True})
        await raw.send({"type": "flush", "context_id": "f", "flush_id": "again", "event_id": "ev-again"})
        await raw.send({"type": "text", "context_id": "f", "text": "four five"})
        await raw.send({"type": "flush", "context_id": "f", "flush_id": 77})
        await raw.send({"type": "text", "context_id": "f", "text": "six"})
        await raw.send({"type": "context.close", "context_id": "f"})
        got = await collect(raw, "f", created["stream_id"])
        flushed = [m for m in got["json"] if m["type"] == "flushed"]
        assert [m["flush_id"] for m in flushed] == ["nothing-yet", 2, "again", 77]
        assert flushed[2]["event_id"] == "ev-again"
        done = got["end"]
        assert done["reason"] == "completed" and done["frames"] == FPW * 6
        ends = [m["audio_end_ms"] for m in flushed]
        assert ends[0] == 0 and ends[1] == ends[2] == pytest.approx(3 * FPW * 80, abs=30)
        assert ends[3] == pytest.approx(5 * FPW * 80, abs=60)
        assert done["audio_ms"] == pytest.approx(6 * FPW * 80 - done["trimmed_ms"], abs=0.1)
        # each segment's first packet carries the segment flag, on one timeline
        packets = got["packets"]
        seg_starts = [p["start_sample"] for p in packets if p["flags"] & 4]
        assert len(seg_starts) == 3 and seg_starts[0] == 0
        assert seg_starts[1] / 24 == pytest.approx(ends[1], abs=0.01)
        assert seg_starts[2] / 24 == pytest.approx(ends[3], abs=0.01)
        total = sum(len(p["payload"]) // 2 for p in packets)
        assert total / 24 == pytest.approx(done["audio_ms"], abs=0.05)
        await raw.close()

    run(go())


def test_flushed_after_its_audio(server):
    """Strict order on the wire: a segment's audio, then its `flushed`."""

    async def go():
        raw = await Raw.open(server.ws_url)
        created = await speak_ctx(raw, "o", [], close=False)
        await raw.send({"type": "text", "context_id": "o", "text": "alpha beta", "flush": True})
        await raw.send({"type": "context.close", "context_id": "o"})
        msgs = await raw.recv_until(lambda m: m.get("type") == "context.done")
        kinds = ["audio" if m["type"] == "binary" else m["type"] for m in msgs
                 if m["type"] != "binary" or m["stream_id"] == created["stream_id"]]
        i = kinds.index("flushed")
        assert set(kinds[:i]) == {"audio"} and kinds[i + 1:] in (["context.done"], ["audio", "context.done"])
        await raw.close()

    run(go())


def test_two_interleaved_contexts(server):
    async def go():
        raw = await Raw.open(server.ws_url)
        a = await speak_ctx(raw, "A", [], close=False)
        b = await speak_ctx(raw, "B", [], create={"output_format": "pcm_16000"}, close=False)
        assert a["stream_id"] != b["stream_id"]
        for wa, wb in zip(words(4, "alpha"), words(3, "beta"), strict=False):
            await raw.send({"type": "text", "context_id": "A", "text": wa})
            await raw.send({"type": "text", "context_id": "B", "text": wb})
        await raw.send({"type": "text", "context_id": "A", "text": words(4, "alpha")[-1]})
        await raw.send({"type": "context.close", "context_id": "B"})
        await raw.send({"type": "context.close", "context_id": "A"})
        msgs = await raw.recv_until(lambda m: m.get("type") == "context.done" and m["context_id"] == "A", 90)
        ends = [m for m in msgs if m.get("type") == "context.done"]
        if len(ends) < 2:
            msgs += await raw.recv_until(lambda m: m.get("type") == "context.done")
            ends = [m for m in msgs if m.get("type") == "context.done"]
        by_ctx = {c: [m for m in msgs if m["type"] == "binary" and m["stream_id"] == s["stream_id"]]
                  for c, s in (("A", a), ("B", b))}
        done = {m["context_id"]: m for m in ends}
        assert done["A"]["frames"] == FPW * 4 and done["B"]["frames"] == FPW * 3
        for c in "AB":
            seqs = [p["seq"] for p in by_ctx[c]]
            assert seqs == list(range(len(seqs)))
            # nothing of a context after its end message
            end_index = msgs.index(done[c])
            sid = a["stream_id"] if c == "A" else b["stream_id"]
            assert not [m for m in msgs[end_index + 1:] if m.get("context_id") == c or m.get("stream_id") == sid]
        b_samples = sum(len(p["payload"]) // 2 for p in by_ctx["B"])
        assert b_samples == pytest.approx(done["B"]["audio_ms"] * 16, abs=1)
        await raw.close()

    run(go())


def test_cancel_mid_utterance(server):
    async def go():
        raw = await Raw.open(server.ws_url)
        created = await speak_ctx(raw, "c", words(30), create={"max_frames": 60})
        sid = created["stream_id"]
        n = 0
        while n < 3:
            m = await raw.recv()
            n += m["type"] == "binary" and m["stream_id"] == sid
        await raw.send({"type": "context.cancel", "context_id": "c", "event_id": "stop"})
        cancelled = await raw.expect("context.cancelled", context_id="c")
        assert cancelled["event_id"] == "stop"
        assert cancelled["generated_ms"] >= cancelled["sent_ms"] >= 3 * 80 * 0.9
        assert cancelled["played_ms"] >= 0
        await raw.send({"type": "ping", "id": "after"})
        tail = await raw.recv_until(lambda m: m.get("type") == "pong")
        assert tail[-1]["id"] == "after"
        tail += await raw.quiet(0.5)
        assert not [m for m in tail if m.get("context_id") == "c" or m.get("stream_id") == sid], tail
        # cancelling again: a warning, not an error; the ended id is context_closed for text
        await raw.send({"type": "context.cancel", "context_id": "c"})
        w = await raw.error("context_not_active")
        assert w["type"] == "warning" and w["context_id"] == "c"
        await raw.send({"type": "text", "context_id": "c", "text": "more"})
        e = await raw.error("context_closed")
        assert e["fatal"] is False
        # late playback reports for the ended context are accepted silently
        await raw.send({"type": "playback", "context_id": "c", "played_ms": 100, "state": "finished"})
        await raw.send({"type": "ping", "id": 2})
        assert (await raw.recv_until(lambda m: m.get("type") in ("pong", "error")))[-1]["type"] == "pong"
        await raw.close()

    run(go())


def test_cancel_all_and_played_map(server):
    async def go():
        raw = await Raw.open(server.ws_url)
        await speak_ctx(raw, "x1", words(20), create={"max_frames": 40})
        await speak_ctx(raw, "x2", words(20), create={"max_frames": 40})
        await raw.send({"type": "cancel_all", "played": {"x1": 40, "x2": 0}})
        got = {}
        while len(got) < 2:
            m = await raw.recv()
            if m.get("type") == "context.cancelled":
                got[m["context_id"]] = m
        assert got["x1"]["played_ms"] == 40 and got["x2"]["played_ms"] == 0
        await raw.close()

    run(go())


def test_json_transport_and_pcm_formats(server):
    async def go():
        raw = await Raw.open(server.ws_url)
        cases = [("j", {"audio_transport": "json"}, 24000, 2),
                 ("f32", {"output_format": {"encoding": "pcm_f32le", "sample_rate": 24000}}, 24000, 4),
                 ("k16", {"output_format": "pcm_16000"}, 16000, 2),
                 ("k8", {"output_format": {"encoding": "pcm_s16le", "sample_rate": 8000}}, 8000, 2),
                 ("mu", {"output_format": "mulaw_8000"}, 8000, 1)]
        for cid, opts, rate, width in cases:
            created = await speak_ctx(raw, cid, ["hello ", "there"], create=opts)
            got = await collect(raw, cid, created["stream_id"])
            done = got["end"]
            assert done["reason"] == "completed", done
            if cid == "j":
                audio = [m for m in got["json"] if m["type"] == "audio"]
                assert not got["packets"] and audio and audio[0]["first"] and audio[-1]["last"]
                assert [m["seq"] for m in audio] == list(range(len(audio)))
                data = b"".join(base64.b64decode(m["data"]) for m in audio)
                assert all(m["start_ms"] >= 0 for m in audio)
            else:
                data = b"".join(p["payload"] for p in got["packets"])
                assert created["output_format"]["sample_rate"] == rate
            assert len(data) % width == 0
            assert len(data) / width == pytest.approx(done["audio_ms"] * rate / 1000, abs=1)
        await raw.close()

    run(go())


def test_implicit_create_session_update_ping(server):
    async def go():
        raw = await Raw.open(server.ws_url)
        await raw.send({"type": "ping", "id": 5, "event_id": "p"})
        pong = await raw.expect("pong")
        assert pong == {"type": "pong", "id": 5, "event_id": "p"}
        await raw.send({"type": "session.update", "event_id": "u1",
                        "defaults": {"voice": "Vivian", "language": "en", "output_format": "pcm_16000",
                                     "sampling": {"temperature": 0.5, "subtalker": {"top_k": 10}}}})
        upd = await raw.expect("session.updated")
        d = upd["defaults"]
        assert upd["event_id"] == "u1" and d["voice"] == "vivian" and d["language"] == "english"
        assert d["output_format"]["sample_rate"] == 16000
        assert d["sampling"]["temperature"] == 0.5 and d["sampling"]["subtalker"]["top_k"] == 10
        # an invalid update is refused whole
        await raw.send({"type": "session.update", "defaults": {"voice": "ryan", "sampling": {"top_p": 7}}})
        e = await raw.error("invalid_field")
        assert e["param"] == "defaults.sampling.top_p"
        await raw.send({"type": "session.update", "defaults": {"voice": "nobody"}})
        e = await raw.error("invalid_field")
        assert e["param"] == "defaults.voice"
        # first text for an unknown id creates the context with the (updated) defaults
        await raw.send({"type": "text", "context_id": "imp", "text": "hi there", "event_id": "t1"})
        created = await raw.expect("context.created", context_id="imp")
        assert created["event_id"] == "t1" and created["output_format"]["sample_rate"] == 16000
        await raw.send({"type": "context.close", "context_id": "imp"})
        got = await collect(raw, "imp", created["stream_id"])
        assert got["end"]["reason"] == "completed"
        await raw.close()

    run(go())


def test_instructions_and_voices_languages(server):
    async def go():
        raw = await Raw.open(server.ws_url)
        created = await speak_ctx(raw, "i", ["Hello."], create={"voice": "UNCLE_FU", "language": "zh",
                                                                "instructions": "Speak warmly."})
        got = await collect(raw, "i", created["stream_id"])
        assert got["end"]["reason"] == "completed"
        for bad, code in (({"voice": "alloy"}, "unknown_voice"), ({"language": "klingon"}, "unknown_language")):
            await raw.send({"type": "context.create", "context_id": "bad", **bad})
            e = await raw.error(code)
            assert e["context_id"] == "bad" and e["fatal"] is False
        await raw.close()

    run(go())


def test_session_close_cancels_open_contexts(server):
    async def go():
        raw = await Raw.open(server.ws_url)
        await speak_ctx(raw, "s1", words(20), create={"max_frames": 40})
        await raw.send({"type": "session.close"})
        cancelled = await raw.expect("context.cancelled", context_id="s1")
        assert cancelled["generated_ms"] >= 0
        code, _ = await raw.closed()
        assert code == 1000

    run(go())


def test_text_normalisation_llm_vs_none(server):
    """Markdown, code fences, links and emoji are dropped before tokenizing: the same seed then gives the same
    codes as the plain text with normalisation off."""

    async def codes(raw, cid, pieces, norm):
        created = await speak_ctx(raw, cid, pieces, create={"text_normalization": norm, "sampling": {"seed": 3}})
        got = await collect(raw, cid, created["stream_id"])
        assert got["end"]["reason"] == "completed"
        return got["end"]["codes_sha256"], got["end"]["frames"]

    async def go():
        raw = await Raw.open(server.ws_url)
        md = ["**Hello** ", "there, ", "see ", "[the ", "docs](https://x.y/z) ", "🎉!\n", "```python\n",
              "print(1)\n", "```\n", "- ", "*done*"]
        plain = "Hello there, see the docs!\ndone"
        a = await codes(raw, "md", md, "llm")
        b = await codes(raw, "plain", [plain], "none")
        c = await codes(raw, "raw", md, "none")
        assert a == b
        assert a != c
        await raw.close()

    run(go())


def test_playback_reports(server):
    async def go():
        raw = await Raw.open(server.ws_url)
        created = await speak_ctx(raw, "pb", words(4))
        await raw.send({"type": "playback", "context_id": "pb", "played_ms": 0, "state": "buffering"})
        await raw.send({"type": "playback", "context_id": "pb", "played_ms": 10, "state": "underrun",
                        "buffered_ms": 0})
        await raw.send({"type": "playback", "context_id": "pb", "played_ms": 20, "state": "paused"})
        e = await raw.error("invalid_field")
        assert e["param"] == "state"
        await raw.send({"type": "playback", "context_id": "nope", "played_ms": 20, "state": "playing"})
        assert (await raw.error("unknown_context"))["context_id"] == "nope"
        got = await collect(raw, "pb", created["stream_id"])
        assert got["end"]["reason"] == "completed"
        await raw.close()

    run(go())


def test_context_log_lines_carry_the_trace_id(server):
    async def go():
        raw = await Raw.open(server.ws_url)
        created = await speak_ctx(raw, "traced-ctx-1", ["log ", "me"])
        await collect(raw, "traced-ctx-1", created["stream_id"])
        await raw.close()
        return created["trace_id"]

    trace = run(go())
    lines = [line for line in server.log_text().splitlines() if "traced-ctx-1" in line]
    assert len(lines) >= 2  # created, ended
    assert all(f"[trace_id={trace}]" in line for line in lines), lines
