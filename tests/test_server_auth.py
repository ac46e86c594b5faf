"""Auth, browser origins, session limits, idle timeouts and slow readers, on the "strict" live server:
--api-key key-one --metrics-key metrics-secret --allowed-origins http://allowed.example --max-sessions 3
--idle-timeout-s 3 --context-idle-timeout-s 1.5 --max-unsent-audio-s 1."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request

import pytest
from live_server import Raw, collect, http_get, live_server, run, speak_ctx
from websockets.asyncio.client import connect

KEY = "key-one"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def strict(tiny_checkpoint):
    return live_server(tiny_checkpoint, "strict")


async def refused(url: str, code: str, close_code: int, **kw) -> dict:
    raw = await Raw.open(url, expect_session=False, **kw)
    err = await raw.recv()
    assert err["type"] == "error" and err["code"] == code and err["fatal"] is True, err
    got, _ = await raw.closed(10)
    assert got == close_code
    return err


def test_ws_auth(strict):
    async def go():
        await refused(strict.ws_url, "unauthorized", 4001)
        await refused(strict.ws_url, "unauthorized", 4001, headers={"Authorization": "Bearer wrong"})
        await refused(strict.ws_url + "?token=key-on", "unauthorized", 4001)
        await refused(strict.ws_url, "unauthorized", 4001, subprotocols=("voicelane.v1", "bearer.nope"))
        for kw in ({"headers": AUTH}, {"url": strict.ws_url + f"?token={KEY}"},
                   {"subprotocols": ("voicelane.v1", f"bearer.{KEY}")}):
            url = kw.pop("url", strict.ws_url)
            raw = await Raw.open(url, **kw)
            assert raw.session["type"] == "session.created"
            assert raw.ws.subprotocol == "voicelane.v1"  # the key is never echoed
            await raw.close()

    run(go())


def test_http_auth_and_open_endpoints(strict):
    body = json.dumps({"input": "hi", "response_format": "pcm", "max_frames": 3}).encode()

    def post(headers):
        req = urllib.request.Request(strict.http_url + "/v1/audio/speech", data=body, method="POST",
                                     headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    status, headers, data = post({})
    assert status == 401 and "Bearer" in headers.get("www-authenticate", "")
    assert json.loads(data)["error"]["code"] == "unauthorized"
    assert post({"Authorization": "Bearer wrong"})[0] == 401
    status, headers, data = post(AUTH)
    assert status == 200 and len(data) > 0 and headers["x-sample-rate"] == "24000"
    assert http_get(strict.http_url + "/v1/models")[0] == 401
    assert http_get(strict.http_url + "/v1/models", AUTH)[0] == 200
    assert http_get(strict.http_url + "/v1/audio/voices", AUTH)[0] == 200
    for path in ("/health", "/ready", "/"):
        assert http_get(strict.http_url + path)[0] == 200, path
    assert http_get(strict.http_url + "/metrics")[0] == 401
    assert http_get(strict.http_url + "/metrics", AUTH)[0] == 401  # an API key is not the metrics key
    status, _, text = http_get(strict.http_url + "/metrics", {"Authorization": "Bearer metrics-secret"})
    assert status == 200 and b"voicelane_ttfa_seconds" in text


def test_origins(strict):
    async def go():
        await refused(strict.ws_url, "origin_not_allowed", 4003, headers=AUTH, origin="http://evil.example")
        for origin in ("http://allowed.example", f"http://127.0.0.1:{strict.port}"):  # listed, and same origin
            raw = await Raw.open(strict.ws_url, headers=AUTH, origin=origin)
            await raw.close()

    run(go())
    req = urllib.request.Request(strict.http_url + "/v1/models", headers={**AUTH, "Origin": "http://evil.example"})
    try:
        urllib.request.urlopen(req, timeout=10)
        raise AssertionError("expected 403")
    except urllib.error.HTTPError as e:
        assert e.code == 403 and json.loads(e.read())["error"]["code"] == "origin_not_allowed"
    status, headers, _ = http_get(strict.http_url + "/v1/models", {**AUTH, "Origin": "http://allowed.example"})
    assert status == 200 and headers.get("access-control-allow-origin") == "http://allowed.example"


def gauge(server, name: str) -> float:
    _, _, text = http_get(server.http_url + "/metrics", {"Authorization": "Bearer metrics-secret"})
    line = next(x for x in text.decode().splitlines() if x.startswith(name + " "))
    return float(line.split()[-1])


def sessions_open(server) -> int:
    return int(gauge(server, "voicelane_ws_sessions"))


def wait_until_none(server, name: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while gauge(server, name) and time.monotonic() < deadline:
        time.sleep(0.1)


def wait_no_sessions(server, timeout: float = 20.0) -> None:
    wait_until_none(server, "voicelane_ws_sessions", timeout)


def test_max_sessions(strict):
    wait_no_sessions(strict)

    async def go():
        open_ = []
        for _ in range(3):
            open_.append(await Raw.open(strict.ws_url, headers=AUTH))
        err = await refused(strict.ws_url, "too_many_sessions", 4029, headers=AUTH)
        assert err["retryable"] is True
        await open_.pop().close()
        for _ in range(50):  # the server notices the close
            try:
                open_.append(await Raw.open(strict.ws_url, headers=AUTH))
                break
            except AssertionError:
                await asyncio.sleep(0.1)
        assert len(open_) == 3
        for raw in open_:
            await raw.close()

    run(go())


def test_context_idle_timeout(strict):
    async def go():
        raw = await Raw.open(strict.ws_url, headers=AUTH)
        created = await speak_ctx(raw, "idle", ["hello ", "there ", "my ", "friend "], close=False)
        t0 = time.monotonic()
        got = await collect(raw, "idle", created["stream_id"], timeout=30)
        assert got["end"]["type"] == "context.done" and got["end"]["reason"] == "timeout"
        assert time.monotonic() - t0 >= 1.4
        assert got["packets"] and got["packets"][-1]["flags"] & 2  # the last packet says so
        await raw.close()

    run(go())


def test_session_idle_timeout(strict):
    async def go():
        raw = await Raw.open(strict.ws_url, headers=AUTH)
        t0 = time.monotonic()
        err = await raw.recv(30)
        assert err["type"] == "error" and err["code"] == "idle_timeout" and err["fatal"] is True
        code, _ = await raw.closed(10)
        assert code == 4008 and time.monotonic() - t0 >= 2.5

    run(go())


def test_slow_reader_is_disconnected(strict):
    """A client that stops reading: unsent audio passes max_unsent_audio_s (1 s) and the server closes with
    4009 instead of buffering; the client sees the close once it reads again.

    What the client does not read first fills the socket buffers, and the server's send buffer grows with the
    traffic up to net.ipv4.tcp_wmem's limit (4 MB here). Asked for 1.5 MB of audio (3 contexts of one 64-frame
    segment), the test passed only when the contexts' audio came fast enough to back up before the buffer grew: a
    slower engine (a loaded machine), or a context refused by admission, let the buffers take all of it, nothing
    was ever unsent, and the session closed idle (4008). So: every context admitted (a refusal is retried), and
    8.8 MB asked for (3 contexts of six 64-frame segments of f32 audio), twice what any buffer here holds."""

    wait_until_none(strict, "voicelane_engine_open_contexts")  # --max-slots 3: lingering contexts would refuse ours
    before = strict.log_text().count("slow reader")
    segment = "many " * 13  # 13 words: 65 frames in benchmark length mode, cut at 64 (--max-frames 64)

    async def create(ws, cid: str) -> None:
        for _ in range(100):
            await ws.send(json.dumps({"type": "context.create", "context_id": cid, "min_frames": 64,
                                      "output_format": {"encoding": "pcm_f32le", "sample_rate": 24000}}))
            while (reply := json.loads(await asyncio.wait_for(ws.recv(), 30))).get("context_id") != cid:
                pass
            if reply["type"] == "context.created":
                return
            assert reply["type"] == "error" and reply["retryable"], reply  # overloaded: try again
            await asyncio.sleep(0.2)
        raise AssertionError(f"context {cid} was never admitted")

    async def go():
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", strict.port))
        sock.setblocking(False)
        async with connect(strict.ws_url, sock=sock, additional_headers=AUTH, max_queue=1, compression=None,
                           max_size=None) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            for i in range(3):
                await create(ws, f"s{i}")
            for i in range(3):
                for _ in range(6):  # 6 x 65 characters: within --max-text-chars-per-context 400
                    await ws.send(json.dumps({"type": "text", "context_id": f"s{i}", "text": segment, "flush": True}))
                await ws.send(json.dumps({"type": "context.close", "context_id": f"s{i}"}))
            # read nothing until the server gives up on us
            deadline = time.monotonic() + 60
            while strict.log_text().count("slow reader") == before and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            kinds = []
            try:
                while True:
                    m = await asyncio.wait_for(ws.recv(), 30)
                    kinds.append("bin" if isinstance(m, bytes) else json.loads(m)["type"])
            except Exception:  # noqa: BLE001 - ConnectionClosed ends the read
                pass
            rcvd = ws.protocol.close_rcvd
            assert rcvd is not None and rcvd.code == 4009, (rcvd, kinds[-5:])
            assert kinds.count("context.done") < 3, kinds  # cut off, not all finished
            assert kinds[-1] == "error"  # the fatal slow_reader error just before the close

    run(go())
    status, _, text = http_get(strict.http_url + "/metrics", {"Authorization": "Bearer metrics-secret"})
    line = next(x for x in text.decode().splitlines() if x.startswith("voicelane_slow_reader_disconnects_total "))
    assert float(line.split()[-1]) >= 1


def test_keys_never_logged(strict):
    log = strict.log_text()
    assert KEY not in log and "metrics-secret" not in log
    assert "token=***" in log  # the ?token= request of test_ws_auth was logged, redacted
