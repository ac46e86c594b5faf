"""Issue 10, item 12 (the smaller defects) and the parts of item 8 that a test can hold: a bounded trace-id store,
every spelling of the key redacted in logs, the Host checked against DNS rebinding on a server without keys, one
INFO line for an aborted upload, a clean error for a port in use, abrupt drops counted as 1006."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from live_server import ROOT, Raw, free_port, http_get, live_server, run

from engine.trace import Timeline
from server.auth import OriginPolicy, query_token
from server.logs import redact


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    return live_server(tiny_checkpoint, "default")


@pytest.fixture(scope="module")
def strict(tiny_checkpoint):
    return live_server(tiny_checkpoint, "strict")


def test_trace_ids_are_bounded():
    """Every context's trace id was kept for ever (1M contexts: one /debug/trace export blocked 2.4 s)."""
    t = Timeline(capacity=100)
    for cid in range(10_000):
        t.name_context(cid, f"trace-{cid}")
        t.instant(cid, "arrival", 0.0)
    assert len(t.trace_ids) == 100 and len(t.events) == 100
    trace = json.loads(t.chrome_trace())
    names = [e for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert [e["tid"] for e in names] == list(range(9_900, 10_000))  # the newest, which the events still name
    assert all(e["args"]["trace_id"] == f"trace-{e['tid']}" for e in trace["traceEvents"] if e["name"] == "arrival")


@pytest.mark.parametrize("spelling", ["token", "TOKEN", "%74oken", "tok%65n", "%54%4F%4B%45%4E", "%2574oken",
                                      "api_key", "api%5Fkey", "key"])
def test_every_spelling_of_the_key_is_redacted(spelling):
    line = f'127.0.0.1:5 - "WebSocket /v1/tts/ws?voice=ryan&{spelling}=s3cret&x=1" [accepted]'
    out = redact(line)
    assert "s3cret" not in out and "voice=ryan" in out and "x=1" in out, out


def test_a_percent_encoded_token_is_accepted_and_never_logged(strict):
    """`?%74oken=<key>` is `?token=<key>` once decoded, so the server accepts it; it was logged in clear."""
    assert query_token(b"%74oken=key-one") == "key-one"

    async def go():
        raw = await Raw.open(strict.ws_url + "?%74oken=key-one&tok%65n=key-one")
        await raw.close()

    run(go())
    time.sleep(0.3)
    log = strict.log_text()
    assert "%74oken=***" in log and "key-one" not in log


def test_dns_rebinding_is_refused_without_keys(server):
    """With no keys, a page on a rebound name (Origin == Host == evil.example) passed the same-origin check."""
    open_policy, keyed = OriginPolicy([], check_host=True), OriginPolicy([], check_host=False)
    assert not open_policy.allows("http://evil.example:8000", "evil.example:8000")
    assert keyed.allows("http://evil.example:8000", "evil.example:8000")  # a key is what protects it then
    for origin, host in (("http://127.0.0.1:8000", "127.0.0.1:8000"), ("http://localhost:8000", "localhost:8000"),
                         ("http://[::1]:8000", "[::1]:8000"), ("http://app.localhost", "app.localhost")):
        assert open_policy.allows(origin, host), (origin, host)
    assert OriginPolicy(["http://evil.example:8000"], check_host=True).allows("http://evil.example:8000", "x")
    assert open_policy.allows(None, "anything.example")  # not a browser: no rebinding

    import http.client

    def post(host: str) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("POST", "/v1/audio/speech", body=json.dumps({"input": "hi"}).encode(),
                     headers={"Host": host, "Origin": f"http://{host}", "Content-Type": "application/json"})
        r = conn.getresponse()
        out = r.status, json.loads(r.read()) if r.status != 200 else {}
        conn.close()
        return out

    status, body = post(f"evil.example:{server.port}")
    assert status == 403 and body["error"]["code"] == "origin_not_allowed", (status, body)
    assert post(f"127.0.0.1:{server.port}")[0] == 200

    async def ws(host: str):
        raw = await Raw.open(server.ws_url, headers={"Origin": f"http://{host}"}, expect_session=False)
        first = await raw.recv()
        if first["type"] == "session.created":
            await raw.close()
            return first, (None, "")
        return first, await raw.closed(10)

    first, _ = run(ws(f"127.0.0.1:{server.port}"))
    assert first["type"] == "session.created"
    # the WebSocket client sends the real Host (127.0.0.1:port): a rebound Origin does not match it
    first, (code, _) = run(ws(f"evil.example:{server.port}"))
    assert first["type"] == "error" and first["code"] == "origin_not_allowed" and code == 4003


def _metric(server, name: str, **labels) -> float:
    _, _, body = http_get(server.http_url + "/metrics")
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in body.decode().splitlines():
        if line.startswith(name + "{") and want in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_an_abrupt_drop_is_1006_and_a_clean_close_is_1000(server):
    before = {c: _metric(server, "voicelane_ws_sessions_total", close_code=c) for c in ("1000", "1005", "1006")}

    async def go():
        dropped = await Raw.open(server.ws_url)
        dropped.ws.transport.abort()  # TCP gone, no close frame
        clean = await Raw.open(server.ws_url)
        await clean.close()
        await asyncio.sleep(1.0)

    run(go())
    after = {c: _metric(server, "voicelane_ws_sessions_total", close_code=c) for c in ("1000", "1005", "1006")}
    assert after["1006"] - before["1006"] == 1, (before, after)
    assert after["1000"] - before["1000"] == 1, (before, after)
    assert after["1005"] == before["1005"], (before, after)


def test_an_aborted_upload_is_one_info_line(server):
    """Each aborted upload wrote two ERROR tracebacks (easy log flooding)."""
    before = server.log_text()
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 5000\r\n\r\n{\"input\": \"hel")
        time.sleep(0.2)
        s.close()
    time.sleep(1.0)
    new = server.log_text()[len(before):]
    lines = [ln for ln in new.splitlines() if "client left during its request body" in ln]
    assert len(lines) == 3 and all(" INFO " in ln for ln in lines), new
    assert "Traceback" not in new and " ERROR " not in new, new


def test_a_port_in_use_is_a_clean_error(tiny_checkpoint):
    """It ended in SIGABRT (uvicorn exited while the model loaded on another thread)."""
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        proc = subprocess.run([sys.executable, "-m", "server", "serve", "--model", str(tiny_checkpoint), "--device",
                               "cpu", "--port", str(port)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert re.search(rf"cannot listen on 127\.0\.0\.1:{port}: .*in use", proc.stderr), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_double_ctrl_c_stops_at_once_without_tracebacks(tiny_checkpoint):
    """Item 8: the first Ctrl-C drains, a second one stops at once; that printed KeyboardInterrupt and
    CancelledError tracebacks (uvicorn re-raised the signal, and skipped the lifespan's shutdown)."""
    from live_server import CONFIGS, speak_ctx, start_server

    server = start_server(tiny_checkpoint, [*CONFIGS["default"], "--drain-timeout-s", "30"])
    try:
        async def go():
            raw = await Raw.open(server.ws_url)
            await speak_ctx(raw, "long", [], close=False)  # never completes: the drain would wait 30 s
            await raw.send({"type": "text", "context_id": "long", "text": "one two three four ", "flush": True})
            await asyncio.sleep(0.5)
            server.signal(signal.SIGINT)
            await raw.expect("session.draining", timeout=10)
            server.signal(signal.SIGINT)
            t0 = time.monotonic()
            await raw.closed(15)
            return t0

        t0 = run(go(), timeout=60)
        code = server.proc.wait(15)
        took = time.monotonic() - t0
        log = server.log_text()
    finally:
        server.stop()
    assert code == 130 and took < 10, (code, took, log[-3000:])
    assert "Traceback" not in log and "KeyboardInterrupt" not in log and "CancelledError" not in log, log[-3000:]
    assert "stopped by SIGINT without draining" in log


def test_setup_says_what_torch_costs_and_takes_a_cpu_only_index():
    """Item 8: on a laptop the pinned torch wheel pulled several GB of CUDA libraries silently. `make setup` now
    says so, shows pip's progress, and takes TORCH_INDEX for a CPU-only wheel (what README documents)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).parents[1]

    def torch_lines(*args: str) -> list[str]:
        venv = "/nonexistent/voicelane-dry-run-venv"  # -n: nothing runs, the recipe is only printed
        out = subprocess.run(["make", "-n", "-B", f"VENV={venv}", f"{venv}/.installed", *args], cwd=root,
                             capture_output=True, text=True, timeout=60, check=True).stdout
        return [line for line in out.splitlines() if "torch==" in line]

    cpu = "https://download.pytorch.org/whl/cpu"
    default = torch_lines()
    assert any("several GB" in line and cpu in line for line in default), default
    install = [line for line in default if "pip install" in line]
    assert install and all("--progress-bar on" in line and "--index-url" not in line for line in install), install
    chosen = [line for line in torch_lines(f"TORCH_INDEX={cpu}") if "pip install" in line]
    assert chosen and all(f"--index-url {cpu}" in line for line in chosen), chosen
    assert f"TORCH_INDEX={cpu}" in (root / "README.md").read_text()
