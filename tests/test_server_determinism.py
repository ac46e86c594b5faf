"""Same text, same seed: the same codes and PCM within 1 LSB (s16), whichever door and however the text arrives:
WebSocket word by word or whole, alone or among 8 concurrent contexts, and HTTP (docs/protocol.md 1.6); and with
the engine in a process of its own."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from live_server import CONFIGS, Raw, collect, http_get, live_server, run, start_server

TEXT = "The quick brown fox jumps over the lazy dog, again."
SEED = 1234


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    return live_server(tiny_checkpoint, "default")


def pieces(mode: str) -> list[str]:
    if mode == "whole":
        return [TEXT]
    if mode == "words":
        out = [w + " " for w in TEXT.split(" ")]
        out[-1] = out[-1].rstrip()
        return out
    return [TEXT[i:i + 3] for i in range(0, len(TEXT), 3)]  # "chars": splits inside words


def http_sse(server) -> tuple[np.ndarray, str]:
    body = json.dumps({"input": TEXT, "voice": "ryan", "response_format": "pcm", "stream_format": "sse",
                       "seed": SEED}).encode()
    req = urllib.request.Request(server.http_url + "/v1/audio/speech", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().split("\n") if line.startswith("data: ")]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    return np.frombuffer(pcm, "<i2"), events[-1]["codes_sha256"]


def test_same_codes_and_pcm_everywhere(server):
    ref_pcm, ref_codes = http_sse(server)
    results: dict[str, tuple[np.ndarray, str]] = {}

    async def one_socket(raw: Raw, jobs: list[tuple[str, str]]):
        created = {}
        for cid, _ in jobs:
            await raw.send({"type": "context.create", "context_id": cid, "sampling": {"seed": SEED}})
        while len(created) < len(jobs):
            m = await raw.recv()
            if m.get("type") == "context.created":
                created[m["context_id"]] = m
        feeds = {cid: pieces(mode) for cid, mode in jobs}
        while any(feeds.values()):  # interleave the contexts' text messages
            for cid, rest in feeds.items():
                if rest:
                    await raw.send({"type": "text", "context_id": cid, "text": rest.pop(0)})
            await asyncio.sleep(0.005)
        for cid, _ in jobs:
            await raw.send({"type": "context.close", "context_id": cid})
        packets = {cid: [] for cid, _ in jobs}
        sid = {created[cid]["stream_id"]: cid for cid, _ in jobs}
        ends = {}
        while len(ends) < len(jobs):
            m = await raw.recv()
            if m["type"] == "binary":
                packets[sid[m["stream_id"]]].append(m["payload"])
            elif m.get("type") == "context.done":
                ends[m["context_id"]] = m
            elif m.get("type") == "error":
                raise AssertionError(m)
        for cid, _ in jobs:
            assert created[cid]["seed"] == SEED and ends[cid]["reason"] == "completed"
            results[cid] = (np.frombuffer(b"".join(packets[cid]), "<i2"), ends[cid]["codes_sha256"])

    async def go():
        raw = await Raw.open(server.ws_url)
        await one_socket(raw, [("alone-whole", "whole")])
        await one_socket(raw, [("alone-words", "words")])
        await one_socket(raw, [(f"many-{i}", ("whole", "words", "chars")[i % 3]) for i in range(8)])
        await raw.close()

    run(go(), timeout=240)
    assert len(results) == 10
    for name, (pcm, codes) in results.items():
        assert codes == ref_codes, name
        assert len(pcm) == len(ref_pcm), name
        diff = np.abs(pcm.astype(np.int32) - ref_pcm.astype(np.int32)).max()
        assert diff <= 1, (name, diff)
    assert np.abs(ref_pcm).max() > 100


def test_different_seed_differs(server):
    async def go():
        raw = await Raw.open(server.ws_url)
        hashes = []
        for seed in (1, 2):
            await raw.send({"type": "context.create", "context_id": f"s{seed}", "sampling": {"seed": seed}})
            created = await raw.expect("context.created")
            await raw.send({"type": "text", "context_id": f"s{seed}", "text": TEXT})
            await raw.send({"type": "context.close", "context_id": f"s{seed}"})
            got = await collect(raw, f"s{seed}", created["stream_id"])
            hashes.append(got["end"]["codes_sha256"])
        await raw.close()
        return hashes

    a, b = run(go())
    assert a != b


def test_the_engine_in_its_own_process_says_the_same(server, tiny_checkpoint):
    """--engine-process on: the same codes and PCM as the engine in the server's process, over HTTP and the
    WebSocket; /ready names the engine's process; when that process dies, /health turns 503 and a new request is
    refused with a typed error instead of hanging."""
    ref_pcm, ref_codes = http_sse(server)
    other = start_server(tiny_checkpoint, [*CONFIGS["default"], "--engine-process", "on"])
    try:
        ready = json.loads(http_get(other.http_url + "/ready")[2])
        assert ready["engine_process"]["enabled"], ready
        pid = int(ready["engine_process"]["mode"].split()[-1])
        assert pid != other.proc.pid
        with open(f"/proc/{other.proc.pid}/maps") as maps:  # the server's own process never loaded torch
            assert "libtorch" not in maps.read()
        pcm, codes = http_sse(other)
        assert codes == ref_codes and np.abs(pcm.astype(np.int32) - ref_pcm.astype(np.int32)).max() <= 1

        async def words():
            raw = await Raw.open(other.ws_url)
            await raw.send({"type": "context.create", "context_id": "w", "sampling": {"seed": SEED}})
            created = await raw.expect("context.created")
            for piece in pieces("words"):
                await raw.send({"type": "text", "context_id": "w", "text": piece})
            await raw.send({"type": "context.close", "context_id": "w"})
            got = await collect(raw, "w", created["stream_id"])
            await raw.close()
            return got["end"]["codes_sha256"]

        assert run(words()) == ref_codes

        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while http_get(other.http_url + "/health")[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        status, _, body = http_get(other.http_url + "/health")
        assert status == 503 and json.loads(body)["status"] == "engine_stopped"
        req = urllib.request.Request(other.http_url + "/v1/audio/speech", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"input": TEXT, "voice": "ryan"}).encode())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=30)
        assert refused.value.code in (500, 503) and json.loads(refused.value.read())["error"]["code"]
    finally:
        other.stop()
