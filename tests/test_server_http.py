"""The HTTP front door (docs/protocol.md 2) against a live server: formats, streaming and not, SSE, errors, the
discovery endpoints, /metrics, client disconnects, and the official `openai` SDK."""

from __future__ import annotations

import base64
import http.client
import io
import json
import struct
import time
import wave

import numpy as np
import opuslib
import pytest
from live_server import CONFIGS, Raw, http_get, live_server, run, speak_ctx, start_server

TEXT = "Hello world, how are you today?"  # 6 words -> 12 frames at 2 frames per word


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    return live_server(tiny_checkpoint, "default")


def post(server, body: dict | bytes, headers: dict | None = None, timeout: float = 60.0):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", "/v1/audio/speech", body=data, headers={"Content-Type": "application/json",
                                                                   **(headers or {})})
    r = conn.getresponse()
    out = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    conn.close()
    return out


def scraped(text: bytes | str, name: str, **labels: str) -> list[float]:
    """The values of the /metrics samples named `name` whose labels include `labels`; parsed, because the order of
    labels in the text is the client library's choice."""
    from prometheus_client.parser import text_string_to_metric_families
    text = text.decode() if isinstance(text, bytes) else text
    return [s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name and labels.items() <= s.labels.items()]


def speech(server, **fields):
    status, headers, data = post(server, {"model": "anything", "input": TEXT, "voice": "ryan", **fields})
    assert status == 200, data
    return headers, data


def test_pcm_streamed_and_whole_agree(server):
    h1, streamed = speech(server, response_format="pcm", seed=21)
    h2, whole = speech(server, response_format="pcm", seed=21, stream=False)
    assert h1["content-type"] == "audio/pcm" and h1["x-sample-rate"] == "24000" and h1["x-seed"] == "21"
    assert h1.get("transfer-encoding") == "chunked" and h1["x-trace-id"]
    assert int(h2["content-length"]) == len(whole) and h2["x-frames"] == "12"
    assert streamed == whole
    assert len(whole) / 2 == pytest.approx(float(h2["x-audio-ms"]) * 24, abs=1)
    assert len(whole) / 2 <= 12 * 1920


def test_seed_is_drawn_and_reported(server):
    h1, a = speech(server, response_format="pcm")
    h2, b = speech(server, response_format="pcm")
    assert h1["x-seed"] != h2["x-seed"] and a != b
    _, c = speech(server, response_format="pcm", seed=int(h1["x-seed"]))
    assert c == a


def test_wav_streaming_and_whole(server):
    _, pcm = speech(server, response_format="pcm", seed=5)
    h, data = speech(server, response_format="wav", seed=5)
    assert h["content-type"] == "audio/wav"
    assert data[:4] == b"RIFF" and struct.unpack("<I", data[4:8])[0] == 0xFFFFFFFF
    assert data[8:16] == b"WAVEfmt " and struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    assert data[44:] == pcm
    h, data = speech(server, response_format="wav", seed=5, stream=False)
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() == len(pcm) // 2 and w.readframes(w.getnframes()) == pcm


def test_mp3(server):
    h, data = speech(server, response_format="mp3", seed=5)
    assert h["content-type"] == "audio/mpeg"
    frames, i = 0, 0
    while i + 4 <= len(data):  # walk the MPEG-2 Layer III frame headers
        b = data[i:i + 4]
        assert b[0] == 0xFF and b[1] & 0xE0 == 0xE0, f"no frame sync at {i}"
        bitrate = [0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160][b[2] >> 4] * 1000
        rate = [22050, 24000, 16000][(b[2] >> 2) & 3]
        i += 72 * bitrate // rate + ((b[2] >> 1) & 1)
        frames += 1
    assert i == len(data) and rate == 24000
    duration_ms = frames * 576 / 24
    assert 12 * 80 - 100 <= duration_ms <= 12 * 80 + 150


def ogg_packets(data: bytes) -> tuple[list[bytes], list[tuple[int, int]]]:
    """Packets and (flags, granule) per page of an Ogg stream."""
    packets, pages, pos, partial = [], [], 0, b""
    while pos < len(data):
        assert data[pos:pos + 4] == b"OggS"
        flags, granule = data[pos + 5], struct.unpack("<q", data[pos + 6:pos + 14])[0]
        nseg = data[pos + 26]
        lacing = data[pos + 27:pos + 27 + nseg]
        pos += 27 + nseg
        for lv in lacing:
            partial += data[pos:pos + lv]
            pos += lv
            if lv < 255:
                packets.append(partial)
                partial = b""
        pages.append((flags, granule))
    return packets, pages


def test_ogg_opus(server):
    h, data = speech(server, response_format="opus", seed=5)
    assert h["content-type"] == "audio/ogg"
    packets, pages = ogg_packets(data)
    assert packets[0][:8] == b"OpusHead" and packets[1][:8] == b"OpusTags"
    channels, pre_skip, rate = packets[0][9], *struct.unpack("<HI", packets[0][10:16])
    assert (channels, pre_skip, rate) == (1, 312, 24000)
    assert pages[0][0] & 2 and pages[-1][0] & 4  # BOS, EOS
    dec = opuslib.Decoder(48000, 1)
    pcm = np.concatenate([np.frombuffer(dec.decode(p, 5760), "<i2") for p in packets[2:]])
    end = pages[-1][1]  # final granule: pre-skip + real samples at 48 kHz
    assert end - pre_skip == pytest.approx(12 * 1920 * 2, abs=2 * 1920)
    assert len(pcm) >= end


def test_sse(server):
    _, pcm = speech(server, response_format="pcm", seed=9)
    h, data = speech(server, response_format="pcm", seed=9, stream_format="sse")
    assert h["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in data.decode().split("\n") if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert events[-1]["type"] == "speech.audio.done" and len(deltas) >= 2
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == pcm
    done = events[-1]
    assert done["usage"]["output_tokens"] == 12 and done["usage"]["input_tokens"] > 0
    assert done["seed"] == 9 and len(done["codes_sha256"]) == 64


def test_sampling_fields_layouts_and_model_names(server):
    _, a = speech(server, response_format="pcm", temperature=0, seed=1)
    _, b = speech(server, response_format="pcm", sampling={"temperature": 0, "seed": 1})
    assert a == b
    _, c = speech(server, response_format="pcm", seed=1, non_streaming_mode=True, model="tts-1")
    _, d = speech(server, response_format="pcm", seed=1, text_layout="whole", model="gpt-4o-mini-tts")
    assert c == d
    speech(server, response_format="pcm", seed=1, speed=1.0, unknown_field={"ignored": True},
           subtalker={"temperature": 0.5}, instructions="Calm.", language="en")


@pytest.mark.parametrize(("body", "status", "code", "param"), [
    (b"{oops", 400, "invalid_json", None),
    ({"input": TEXT, "speed": 1.5}, 400, "invalid_field", "speed"),
    ({"input": TEXT, "temperature": 0.5, "sampling": {"temperature": 0.5}}, 400, "invalid_field", "temperature"),
    ({"input": TEXT, "top_p": 3}, 400, "invalid_field", "sampling.top_p"),
    ({"input": TEXT, "max_frames": 0}, 400, "invalid_field", "max_frames"),
    ({"input": TEXT, "non_streaming_mode": True, "text_layout": "dual"}, 400, "invalid_field", "non_streaming_mode"),
    ({"input": ""}, 400, "invalid_field", "input"),
    ({"input": "🎉🎉"}, 400, "invalid_field", "input"),
    ({"voice": "ryan"}, 400, "invalid_field", "input"),
    ({"input": TEXT, "voice": "alloy"}, 400, "unknown_voice", "voice"),
    ({"input": TEXT, "language": "xx"}, 400, "unknown_language", "language"),
    ({"input": TEXT, "response_format": "aac"}, 400, "unsupported_format", "response_format"),
    ({"input": "a" * 100_001}, 413, "text_too_long", "input"),
])
def test_errors(server, body, status, code, param):
    got, headers, data = post(server, body)
    err = json.loads(data)["error"]
    assert got == status and err["code"] == code and err["param"] == param, err
    assert err["message"] and err["type"]


def test_discovery_endpoints(server):
    status, _, data = http_get(server.http_url + "/v1/models")
    models = json.loads(data)
    assert status == 200 and models["object"] == "list" and models["data"][0]["object"] == "model"
    status, _, data = http_get(server.http_url + "/v1/audio/voices")
    voices = json.loads(data)
    assert {v["name"] for v in voices["voices"]} >= {"ryan", "vivian"} and "english" in voices["languages"]
    status, _, data = http_get(server.http_url + "/health")
    assert status == 200 and json.loads(data)["status"] == "ok"
    status, _, data = http_get(server.http_url + "/ready")
    ready = json.loads(data)
    assert status == 200 and ready["ready"] and ready["warmed_up"] and "cuda_graphs" in ready
    kernels = ready["triton_kernels"]  # what the fused kernels do here, and why: never a stale or silent answer
    assert kernels["enabled"] is False and kernels["reason"].startswith("CPU device")
    assert kernels["details"]["cuda_kernels"] in ("triton", "torch") and "pdl" in kernels["details"]
    assert kernels["details"]["short_attention"] == {"on": False, "switch": "VOICELANE_SHORT_ATTENTION"}
    assert kernels["details"]["cp_forward"]["mode"] == "off" and kernels["details"]["cp_forward"]["tiles"]["k"] == 128
    chain = ready["first_audio_chain"]  # on by default; on a CPU it may have given way (a slow chain), and says why
    assert chain["enabled"] or chain["reason"].startswith("gave way to three steps")
    status, _, data = http_get(server.http_url + "/")
    assert status == 200 and b"<html" in data.lower() or b"<!doctype" in data.lower()
    assert http_get(server.http_url + "/nope")[0] == 404


def test_client_gone_cancels(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/audio/speech", body=json.dumps({"input": "word " * 40, "response_format": "pcm",
                                                               "max_frames": 64}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.read(1000)
    conn.sock.close()
    conn.close()
    for _ in range(100):
        _, _, text = http_get(server.http_url + "/metrics")
        if scraped(text, "voicelane_contexts_total", transport="http", reason="client_gone"):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the server did not notice the client leaving")


def test_metrics(server):
    speech(server, response_format="pcm")
    speech(server, response_format="pcm")  # the same voice again: its prompt prefix comes from the cache

    async def playback():  # an underrun report is counted
        raw = await Raw.open(server.ws_url)
        await speak_ctx(raw, "m", ["a ", "b"], close=False)
        await raw.send({"type": "playback", "context_id": "m", "played_ms": 0, "state": "underrun"})
        await raw.send({"type": "context.close", "context_id": "m"})
        await raw.expect("context.done")
        await raw.close()

    run(playback())
    status, headers, text = http_get(server.http_url + "/metrics")
    text = text.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for needle in ('voicelane_ttfa_seconds_count', 'voicelane_active_contexts', 'voicelane_rejections_total',
                   'voicelane_client_underruns_total'):
        assert needle in text, needle
    for name, labels in (("voicelane_ttfa_seconds_bucket", {"transport": "http", "le": "+Inf"}),
                         ("voicelane_engine_queue_depth", {"stage": "talker"}),
                         ("voicelane_engine_batch_size", {"stage": "codec"}),
                         ("voicelane_engine_step_seconds_bucket", {"stage": "talker"}),
                         ("voicelane_ttfa_seconds_bucket", {"transport": "ws"})):
        assert scraped(text, name, **labels), (name, labels)
    assert scraped(text, "voicelane_prefix_cache_hits_total")[0] >= 1
    assert scraped(text, "voicelane_prefix_cache_misses_total")[0] >= 1  # the warm-up's voice, at least
    assert scraped(text, "voicelane_prefix_cache_entries")[0] >= 1
    assert scraped(text, "voicelane_prefix_cache_bytes")[0] > 0
    assert scraped(text, "voicelane_prefix_cache_evictions_total") == [0]
    assert scraped(text, "voicelane_engine_max_slots")[0] == 64  # auto on a CPU
    underruns = [line for line in text.splitlines() if line.startswith("voicelane_client_underruns_total ")]
    assert float(underruns[0].split()[-1]) >= 1


def test_openai_sdk_streams_a_valid_wav(server, tmp_path):
    import openai  # required (CI installs it): the official SDK is what OpenAI-shaped clients use
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0)
    out = tmp_path / "speech.wav"
    with client.audio.speech.with_streaming_response.create(model="voicelane", voice="ryan", input=TEXT,
                                                            response_format="wav") as response:
        assert response.headers["content-type"] == "audio/wav"
        response.stream_to_file(out)
    with wave.open(str(out)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        frames = w.readframes(10**7)
    assert len(frames) // 2 == pytest.approx(12 * 1920, abs=1920)
    assert np.abs(np.frombuffer(frames, "<i2")).max() > 100
    models = client.models.list()
    assert models.data[0].id


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_http_overloaded_503(tiny_checkpoint, engine_process):
    """Every slot taken: 503 overloaded with Retry-After. With the engine in its own process the open is pipelined
    (the refusal arrives as the context's first event), and the answer is the same."""
    if engine_process == "on":
        strict = start_server(tiny_checkpoint, [*CONFIGS["strict"], "--engine-process", "on"])
    else:
        strict = live_server(tiny_checkpoint, "strict")
    auth = {"Authorization": "Bearer key-one"}

    async def go():
        raw = await Raw.open(strict.ws_url, headers=auth)
        for i in range(3):  # the strict server's 3 engine slots
            await speak_ctx(raw, f"h{i}", [], close=False)
        for stream in (True, False):  # the streamed response and the whole one
            status, headers, data = post(strict, {"input": TEXT, "response_format": "pcm", "stream": stream}, auth)
            assert status == 503 and headers["retry-after"] == "1"
            assert json.loads(data)["error"]["code"] == "overloaded"
        await raw.send({"type": "cancel_all"})
        for _ in range(3):
            await raw.expect("context.cancelled")
        await raw.close()

    try:
        run(go())
    finally:
        if engine_process == "on":
            strict.stop()


def test_demo_page_and_assets(server):
    from pathlib import Path

    web = Path(__file__).resolve().parent.parent / "client_demo" / "web"
    status, headers, body = http_get(server.http_url + "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    if (web / "index.html").is_file():
        assert body == (web / "index.html").read_bytes()
        for asset in sorted(p.name for p in web.iterdir() if p.suffix in (".js", ".css")):
            status, headers, _ = http_get(server.http_url + "/" + asset)
            assert status == 200, asset
    assert http_get(server.http_url + "/../server/cli.py")[0] == 404


def test_synthesis_failure(server):
    """Before any audio: a proper 500 synthesis_failed; mid-stream: SSE ends with an error event."""
    status, _, data = post(server, {"input": TEXT, "response_format": "pcm",
                                    "test_fault": {"kind": "exception", "at_frame": 0}})
    assert status == 500 and json.loads(data)["error"]["code"] == "synthesis_failed"
    status, _, data = post(server, {"input": TEXT, "response_format": "pcm", "stream_format": "sse",
                                    "test_fault": {"kind": "nan", "at_frame": 6}})
    events = [json.loads(line[6:]) for line in data.decode().split("\n") if line.startswith("data: ")]
    assert status == 200 and events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "synthesis_failed"
    status, _, data = post(server, {"input": TEXT, "response_format": "pcm", "stream": False,
                                    "test_fault": {"kind": "exception", "at_frame": 6}})
    assert status == 500 and json.loads(data)["error"]["code"] == "synthesis_failed"
