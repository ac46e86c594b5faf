"""Draining on SIGTERM (docs/protocol.md 1.2 / 1.5): `session.draining`, new contexts and requests refused, contexts in
flight finish, those still open at the deadline are cancelled, then close 1001 and a clean exit."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

from live_server import CONFIGS, Raw, http_get, run, speak_ctx, start_server


def test_sigterm_drains(tiny_checkpoint):
    server = start_server(tiny_checkpoint, [*CONFIGS["default"], "--drain-timeout-s", "8"])
    try:
        async def go():
            raw = await Raw.open(server.ws_url)
            done_ctx = await speak_ctx(raw, "finishing", [f"w{i} " for i in range(4)], create={"max_frames": 30})
            await speak_ctx(raw, "lingering", ["hello ", "there "], close=False)  # input never closes
            t0 = time.monotonic()
            server.signal(signal.SIGTERM)
            draining = await raw.expect("session.draining", timeout=10)
            assert 0 < draining["deadline_s"] <= 8
            await raw.send({"type": "context.create", "context_id": "late", "event_id": "late"})
            err = await raw.error("overloaded")
            assert err["retryable"] is True and err["context_id"] == "late" and err["fatal"] is False
            # HTTP and new sessions are refused while draining; /health stays up, /ready says why
            req = urllib.request.Request(server.http_url + "/v1/audio/speech",
                                         data=json.dumps({"input": "hi"}).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(req, timeout=10)
                raise AssertionError("expected 503")
            except urllib.error.HTTPError as e:
                assert e.code == 503 and e.headers["Retry-After"]
            status, _, body = http_get(server.http_url + "/ready")
            assert status == 503 and json.loads(body)["draining"] is True
            assert http_get(server.http_url + "/health")[0] == 200
            refused = await Raw.open(server.ws_url, expect_session=False)
            first = await refused.recv()
            assert first["type"] == "error" and first["fatal"] is True
            assert (await refused.closed(10))[0] == 1001
            # the closed context finishes; the open one is cancelled at the deadline; then 1001
            ends = {}
            while len(ends) < 2:
                m = await raw.recv(30)
                if m.get("type") in ("context.done", "context.cancelled"):
                    ends[m["context_id"]] = m
            assert ends["finishing"]["type"] == "context.done" and ends["finishing"]["reason"] == "completed"
            assert ends["lingering"]["type"] == "context.cancelled"
            code, _ = await raw.closed(30)
            assert code == 1001
            assert time.monotonic() - t0 >= 7.5
            assert done_ctx["stream_id"]

        run(go())
        assert server.proc.wait(30) == 0
    finally:
        server.stop()


def test_a_sigterm_to_the_whole_group_drains_with_the_engine_in_its_own_process(tiny_checkpoint):
    """systemd (KillMode=control-group), `timeout` and a shell's job control send SIGTERM to every process of the
    group, the engine process included. It leaves the decision to the server: the context in flight finishes its
    audio and the server exits cleanly, instead of the stream failing with "engine stopped"."""
    server = start_server(tiny_checkpoint, [*CONFIGS["default"], "--engine-process", "on", "--drain-timeout-s", "20"])
    try:
        async def go():
            raw = await Raw.open(server.ws_url)
            await raw.send({"type": "context.create", "context_id": "c", "max_frames": 40, "min_frames": 40})
            await raw.expect("context.created")
            await raw.send({"type": "text", "context_id": "c", "text": "one two three four five six seven."})
            await raw.send({"type": "context.close", "context_id": "c"})
            os.killpg(server.proc.pid, signal.SIGTERM)
            await raw.expect("session.draining", timeout=10)
            while True:
                m = await raw.recv(60)
                if m.get("type") in ("context.done", "context.cancelled", "error"):
                    return m

        end = run(go())
        assert end["type"] == "context.done" and end["reason"] == "completed", end
        assert server.proc.wait(30) == 0
        assert "engine process exited" not in server.log_text()
    finally:
        server.stop()
