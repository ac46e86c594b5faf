"""The load generator against small fake servers whose answers are known by construction (no model).

The fakes send 3 packets of 960 samples (40 ms each): the first holds 480 samples of silence then a -20 dBFS tone,
so every stream's audible onset is at 240 samples (10 ms: the window [240, 720) is half tone). Prompts of 13
words are refused (HTTP 503 / `overloaded`); for prompts of 16 words the third packet is held back 300 ms after
the second: one underrun, by construction. Assertions count requests and underruns; they never bound a time.
"""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from bench.loadgen import PointConfig, llm_pieces, run_point
from bench.prompts import SENTENCES
from voicelane_wire import pack_frame

PACKET = 960
REFUSE_WORDS, LATE_WORDS = 13, 16


def _audio(packets: int = 3) -> list[bytes]:
    n = packets * PACKET
    t = np.arange(n) / 24000
    x = math.sqrt(2) * 0.1 * np.sin(2 * np.pi * 1000 * t)
    x[:480] = 0.0
    pcm = np.round(x * 32767).astype("<i2").tobytes()
    return [pcm[k * 2 * PACKET : (k + 1) * 2 * PACKET] for k in range(packets)]


ANSWERED = [0]  # speech requests the HTTP fake has answered with audio (all tests)


def _fake_metrics() -> bytes:
    """/metrics of the HTTP fake: each request answered had a 10 ms TTFA, 4 ms of it queue and 6 ms send."""
    n, lines = ANSWERED[0], []
    families = {"voicelane_ttfa_seconds": [('transport="http"', 0.010)],
                "voicelane_first_audio_phase_seconds": [('phase="queue",transport="http"', 0.004),
                                                        ('phase="send",transport="http"', 0.006)]}
    for name, series in families.items():
        lines.append(f"# TYPE {name} histogram")
        for labels, seconds in series:
            lines += [f'{name}_bucket{{{labels},le="{seconds}"}} {n}', f'{name}_bucket{{{labels},le="+Inf"}} {n}',
                      f"{name}_count{{{labels}}} {n}", f"{name}_sum{{{labels}}} {n * seconds}"]
    text = ("\n".join(lines) + "\n").encode()
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s" % (len(text), text)


async def _http_fake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET /metrics "):
                writer.write(_fake_metrics())
                await writer.drain()
                continue
            headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:] if ": " in line)
            length = int({k.lower(): v for k, v in headers.items()}.get("content-length", 0))
            body = json.loads(await reader.readexactly(length))
            words = len(body["input"].split())
            assert body["response_format"] == "pcm" and body["stream"] is True and body["voice"] == "Ryan"
            if words == REFUSE_WORDS:
                msg = b'{"error":{"message":"busy","type":"overloaded","param":null,"code":"overloaded"}}'
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                             b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(msg), msg))
                await writer.drain()
                continue
            ANSWERED[0] += 1
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: audio/pcm\r\nx-sample-rate: 24000\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            for k, chunk in enumerate(_audio()):
                if k == 2 and words == LATE_WORDS:
                    await asyncio.sleep(0.3)
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


class WsFake:
    """Contexts on one socket. Audio starts at the first text (like the server) and is paced `pace` s per packet;
    `context.done` follows the close and the last packet; `context.cancel` stops it at once."""

    def __init__(self, packets_per_word: int = 0, pace: float = 0.0, fpw: int = 0):
        self.packets_per_word, self.pace, self.fpw = packets_per_word, pace, fpw
        self.texts: dict[str, list[str]] = {}
        self.cancelled: set[str] = set()

    async def handler(self, ws) -> None:
        await ws.send(json.dumps({"type": "session.created", "session_id": "s", "protocol": "voicelane/1",
                                  "model": "fake", "limits": {"max_contexts": 8}, "bench_frames_per_word": self.fpw}))
        contexts: dict[str, dict] = {}
        tasks = []
        async for raw in ws:
            m = json.loads(raw)
            cid = m.get("context_id")
            if m["type"] == "context.create":
                contexts[cid] = {"sid": len(contexts) + 1, "closed": asyncio.Event(), "started": False}
                self.texts[cid] = []
                await ws.send(json.dumps({"type": "context.created", "context_id": cid,
                                          "stream_id": contexts[cid]["sid"], "trace_id": "t", "seed": 1}))
            elif m["type"] == "text":
                c = contexts[cid]
                self.texts[cid].append(m["text"])
                if self.packets_per_word and not c["started"]:
                    c["started"] = True
                    tasks.append(asyncio.ensure_future(self._stream(ws, cid, c)))
            elif m["type"] == "context.close":
                c = contexts[cid]
                c["closed"].set()
                words = len("".join(self.texts[cid]).split())
                if not self.packets_per_word and words == REFUSE_WORDS:
                    await ws.send(json.dumps({"type": "error", "code": "overloaded", "message": "busy",
                                              "context_id": cid, "fatal": False, "retryable": True}))
                elif not c["started"]:
                    c["started"] = True
                    tasks.append(asyncio.ensure_future(self._stream(ws, cid, c, late=words == LATE_WORDS)))
            elif m["type"] == "context.cancel":
                self.cancelled.add(cid)
                await ws.send(json.dumps({"type": "context.cancelled", "context_id": cid, "generated_ms": 0,
                                          "sent_ms": 0, "played_ms": m.get("played_ms", 0)}))
            elif m["type"] == "session.close":
                break
        for t in tasks:
            t.cancel()

    async def _stream(self, ws, cid: str, c: dict, late: bool = False) -> None:
        if not self.packets_per_word:  # whole text known: 3 packets, the last one flagged
            for k, chunk in enumerate(_audio(3)):
                if k == 2 and late:
                    await asyncio.sleep(0.3)
                await ws.send(pack_frame(c["sid"], k, k * PACKET, chunk, first=k == 0, segment_start=k == 0,
                                         last=k == 2))
        else:  # streaming: packets_per_word per word received so far, then an empty last packet after the close
            k, chunks = 0, []
            while True:
                n = self.packets_per_word * len("".join(self.texts[cid]).split())
                if k >= n:
                    if c["closed"].is_set():
                        break
                    await asyncio.sleep(0.005)
                    continue
                if len(chunks) <= k:
                    chunks = _audio(n)
                if cid in self.cancelled:
                    return
                if k:
                    await asyncio.sleep(self.pace)
                await ws.send(pack_frame(c["sid"], k, k * PACKET, chunks[k], first=k == 0, segment_start=k == 0))
                k += 1
            if cid in self.cancelled:
                return
            await ws.send(pack_frame(c["sid"], k, k * PACKET, b"", last=True))
        await c["closed"].wait()
        if cid not in self.cancelled:
            await ws.send(json.dumps({"type": "context.done", "context_id": cid, "reason": "completed",
                                      "audio_ms": 0, "ttfa_ms": 1.0}))


def _cfg(url: str, workload: str, **kw) -> PointConfig:
    base = dict(url=url, workload=workload, rps=8.0, arrival="constant", warmup=0.3, window=1.5, seed=0,
                drain_timeout=10.0, request_timeout=10.0, records="all")
    return PointConfig(**(base | kw))


def _check_point(point: dict, expected_arrivals: int) -> None:
    recs = [r for r in point["requests"] if r["phase"] == "measured"]
    s = point["summary"]
    assert s["offered"] == len(recs) == expected_arrivals
    refused = [r for r in recs if r["words"] == REFUSE_WORDS]
    late = [r for r in recs if r["words"] == LATE_WORDS]
    assert s["errors"] == len(refused) and s["errors_by_kind"] == ({"refused": len(refused)} if refused else {})
    assert s["underrun_requests"] == len(late) and s["underrun_packets"] == len(late)
    for r in recs:
        if r["words"] == REFUSE_WORDS:
            assert r["status"] == "refused"
            continue
        assert r["status"] == "ok", r
        assert r["onset_ms"] == 10.0
        assert r["audio_ms"] == 120.0
        assert r["underruns"] == (1 if r["words"] == LATE_WORDS else 0)
        if r["words"] != LATE_WORDS:  # no stall before the onset: it plays 10 ms after the first sample
            assert r["audible_ttfa_ms"] == pytest.approx(r["first_playable_ms"] + 10.0, abs=1e-6)
        assert r["first_playable_ms"] <= r["e2e_ms"]
    assert s["peak_in_flight"] >= 1
    assert s["latency_ms"]["audible_ttfa_ms"]["n"] == len(recs)


def _measured_prompts(seed: int, rps: float, warmup: float, window: float) -> int:
    from bench.schedule import constant_schedule

    t = constant_schedule(rps, warmup + window)
    return int(np.sum((t >= warmup) & (t < warmup + window)))


@pytest.mark.parametrize("client", ["lean", "httpx"])
def test_w1_http_against_a_fake_server(client):
    async def go():
        srv = await asyncio.start_server(_http_fake, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:
            return await run_point(_cfg(f"http://127.0.0.1:{port}", "w1", http_client=client))
        finally:
            srv.close()

    point = asyncio.run(go())
    _check_point(point, _measured_prompts(0, 8.0, 0.3, 1.5))
    recs = [r for r in point["requests"] if r["phase"] == "measured"]
    assert all(r["http_status"] == (503 if r["words"] == REFUSE_WORDS else 200) for r in recs)
    assert [r["prompt"] for r in point["requests"][:3]] == [SENTENCES.index(s) for s in
                                                            __import__("bench.prompts").prompts.prompt_sequence(0, 3)]
    # the fake's /metrics at the window's start and end: the requests answered between them, 10 ms each
    server = point["server_first_audio"]
    assert server["transport"] == "http" and 1 <= server["ttfa_ms"]["count"] <= len(recs)
    assert server["ttfa_ms"]["mean"] == pytest.approx(10.0) and list(server["phases_ms"]) == ["queue", "send"]
    assert server["phases_ms"]["queue"]["mean"] == pytest.approx(4.0)
    heard = [r["audible_ttfa_ms"] for r in recs if r["status"] == "ok"]
    assert server["client_audible_ttfa_ms"]["count"] == len(heard)  # the refused requests left out
    assert server["client_minus_server_ms"]["mean"] == pytest.approx(np.mean(heard) - 10.0)


def test_w1_from_several_client_processes_is_the_same_point():
    """--procs 3: three client processes send every third arrival of one shared schedule; the report holds every
    arrival once, in order, each with the prompt the one-process run sends; the parent scrapes /metrics."""
    async def go():
        srv = await asyncio.start_server(_http_fake, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:
            return await run_point(_cfg(f"http://127.0.0.1:{port}", "w1", procs=3))
        finally:
            srv.close()

    point = asyncio.run(go())
    _check_point(point, _measured_prompts(0, 8.0, 0.3, 1.5))
    recs = point["requests"]
    ids = [r["id"] for r in recs]
    assert ids == sorted(ids) and len(set(ids)) == len(ids) and ids[0] == 0
    assert ids == list(range(len(ids)))  # no arrival lost or sent twice across the processes
    prompts = __import__("bench.prompts").prompts.prompt_sequence(0, len(ids))
    assert [r["prompt"] for r in recs] == [SENTENCES.index(t) for t in prompts]
    assert point["summary"]["peak_in_flight"] >= 1
    assert point["server_first_audio"]["ttfa_ms"]["count"] >= 1
    assert point["client"]["processes"] == 3


def test_peak_in_flight_counts_overlaps_inside_the_window():
    from bench.loadgen import peak_in_flight

    recs = [{"dispatch_s": 0.0, "e2e_ms": 3000.0}, {"dispatch_s": 1.5, "e2e_ms": 1000.0},
            {"dispatch_s": 2.0, "e2e_ms": 100.0}, {"dispatch_s": 5.0, "e2e_ms": 1000.0},
            {"dispatch_s": 2.05, "e2e_ms": None}, {"dispatch_s": None}]
    assert peak_in_flight(recs, 1.0, 4.0) == 4  # at 2.05 s: the first three and the one that failed at once
    assert peak_in_flight(recs, 3.5, 10.0) == 1
    assert peak_in_flight(recs, 6.5, 10.0) == 0


def test_w2_websocket_word_by_word_against_a_fake_server():
    from websockets.asyncio.server import serve

    fake = WsFake()

    async def go():
        async with serve(fake.handler, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            return await run_point(_cfg(f"http://127.0.0.1:{port}", "w2"))

    point = asyncio.run(go())
    _check_point(point, _measured_prompts(0, 8.0, 0.3, 1.5))
    assert "/metrics at the window's start" in point["server_first_audio"]["error"]  # the fake has none
    # one word and its trailing space per text message, for every request that ran to its end (one the run's end
    # cut, in the cooldown, sent only the words it had reached)
    whole = [r for r in point["requests"] if r["status"] == "ok"]
    assert len(whole) >= len([r for r in point["requests"] if r["phase"] == "measured"])
    for r in whole:
        text = SENTENCES[r["prompt"]]
        assert fake.texts[f"r{r['id']}"] == [w + " " for w in text.split()]
    assert point["client"]["sessions_opened"] >= 1


def test_w3_conversations_with_barge_in():
    from websockets.asyncio.server import serve

    fake = WsFake(packets_per_word=2, pace=0.02, fpw=1)  # 80 ms of audio per word, sent at 2x real time

    async def go():
        async with serve(fake.handler, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            cfg = _cfg(f"http://127.0.0.1:{port}", "w3", rps=6.0, turns=2, barge_in=0.5, warmup=0.2, window=1.5,
                       tokens_per_s=(400.0, 600.0), sentences_per_reply=(1, 1), pause_s=(0.02, 0.05))
            return await run_point(cfg)

    point = asyncio.run(go())
    recs = [r for r in point["requests"] if r["phase"] == "measured"]
    assert recs and point["summary"]["errors"] == 0
    assert {r["status"] for r in recs} <= {"ok", "cancelled"}
    cancelled = [r for r in recs if r["status"] == "cancelled"]
    for r in cancelled:
        assert r["barge_in_planned"] and r["e2e_ms"] is None and r["cancel_to_ack_ms"] >= 0
        assert r["audio_ms"] < r["words"] * 80.0
        assert r["id"] in fake.cancelled
    for r in recs:
        if r["status"] == "ok":
            assert r["audio_ms"] == r["words"] * 80.0 and r["onset_ms"] == 10.0
    assert point["barge_in"]["cancelled"] == len(cancelled)
    # each reply was streamed as LLM-sized pieces that add up to the text
    for r in point["requests"]:
        if r["id"] in fake.texts:
            assert "".join(fake.texts[r["id"]]) == " ".join(SENTENCES[i] for i in r["prompts"])


def test_llm_pieces():
    assert llm_pieces("Hello wonderful world") == ["Hello", " wond", "erfu", "l", " world"]
    assert "".join(llm_pieces("Preheat the oven to four hundred degrees.")) == \
        "Preheat the oven to four hundred degrees."


def test_client_cap_counts_as_error():
    async def go():
        srv = await asyncio.start_server(_http_fake, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:
            return await run_point(_cfg(f"http://127.0.0.1:{port}", "w1", max_in_flight=0, warmup=0.0,
                                        window=0.5))
        finally:
            srv.close()

    point = asyncio.run(go())
    s = point["summary"]
    assert s["offered"] == 4 and s["errors_by_kind"] == {"client_cap": 4}
    assert s["latency_ms"]["audible_ttfa_ms"]["p50"] == math.inf
