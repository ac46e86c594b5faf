"""A real server process for tests: `python -m server serve --model <dir> --device cpu --port <free port> ...`,
started once per configuration for the whole pytest session, reached over loopback only, stopped at exit.

    server = live_server(tiny_checkpoint, "default")      # shared by every test module that asks for it
    server.ws_url, server.http_url, server.log_tail()

Test servers run with admission by predicted load and by predicted first audio off (--admission-load 1000,
--admission-first-audio-ms 0): the CPU is shared with other test processes, and admission is the engine's own test
subject. They use one torch thread (OpenMP workers spin between ops, and several servers share the machine's
cores).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from voicelane_wire import unpack_frame

ROOT = Path(__file__).resolve().parent.parent
BASE_ARGS = ["--device", "cpu", "--cpu-threads", "1", "--max-frames", "64", "--admission-load", "1000",
             "--admission-first-audio-ms", "0", "--encode-threads", "2", "--log-level", "info"]

CONFIGS: dict[str, list[str]] = {
    # protocol, HTTP, determinism tests: 2 frames per word makes lengths exact and short
    "default": ["--bench-frames-per-word", "2", "--enable-test-hooks", "--max-contexts", "8"],
    # auth, origins, limits, timeouts, slow readers
    "strict": ["--api-key", "key-one", "--metrics-key", "metrics-secret", "--allowed-origins",
               "http://allowed.example", "--max-sessions", "3", "--idle-timeout-s", "3",
               "--context-idle-timeout-s", "1.5", "--max-unsent-audio-s", "1", "--max-slots", "3",
               "--max-contexts", "8", "--max-text-chars-per-message", "200", "--max-text-chars-per-context", "400",
               "--max-message-bytes", "4096"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, headers: dict | None = None, timeout: float = 10.0) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


class LiveServer:
    def __init__(self, checkpoint: Path, args: list[str], env: dict | None = None, ready_timeout: float = 120.0):
        self.port = free_port()
        self.http_url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/tts/ws"
        self.log_path = Path(tempfile.mkstemp(prefix="voicelane-server-", suffix=".log")[1])
        self.cmd = [sys.executable, "-m", "server", "serve", "--model", str(checkpoint), "--port", str(self.port),
                    *BASE_ARGS, *args]
        full_env = {k: v for k, v in os.environ.items() if k != "VOICELANE_API_KEYS"}
        # one torch thread: OpenMP workers spin between ops, and several test servers share two cores
        full_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})})
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)
        self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                status, _, body = http_get(self.http_url + "/ready", timeout=2)
                if status == 200:
                    return json.loads(body)
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log_tail()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        if not os.environ.get("VOICELANE_KEEP_TEST_LOGS"):
            self.log_path.unlink(missing_ok=True)
        return self.proc.returncode


_SERVERS: dict[str, LiveServer] = {}


def live_server(checkpoint: Path, name: str = "default") -> LiveServer:
    """The shared server of configuration `name` (started on first use, stopped when pytest exits)."""
    server = _SERVERS.get(name)
    if server is None or server.proc.poll() is not None:
        server = LiveServer(checkpoint, CONFIGS[name])
        _SERVERS[name] = server
    return server


def start_server(checkpoint: Path, args: list[str], env: dict | None = None) -> LiveServer:
    """A private server (the caller stops it), e.g. for draining tests."""
    return LiveServer(checkpoint, args, env)


@atexit.register
def _stop_all() -> None:
    for server in _SERVERS.values():
        try:
            server.stop(5)
        except Exception:  # noqa: BLE001
            pass


# ------------------------------------------------------------------------------ raw protocol helpers

TIMEOUT = 60.0


def run(coro, timeout: float = 120.0):
    async def guarded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(guarded())


class Raw:
    """A raw WebSocket: send dicts, read messages one by one (JSON as dicts, binary as parsed frames)."""

    def __init__(self, ws):
        self.ws = ws
        self.session: dict | None = None

    @classmethod
    async def open(cls, url: str, *, headers: dict | None = None, subprotocols=("voicelane.v1",), origin=None,
                   expect_session: bool = True, **kw) -> Raw:
        ws = await connect(url, additional_headers=headers or {}, subprotocols=list(subprotocols) or None,
                           origin=origin, compression=None, max_size=8 * 1024 * 1024, **kw)
        raw = cls(ws)
        if expect_session:
            first = await raw.recv()
            assert first["type"] == "session.created", first
            raw.session = first
        return raw

    async def send(self, msg: dict | str | bytes) -> None:
        if isinstance(msg, dict):
            msg = json.dumps(msg)
        await self.ws.send(msg)

    async def recv(self, timeout: float = TIMEOUT) -> Any:
        data = await asyncio.wait_for(self.ws.recv(), timeout)
        if isinstance(data, bytes):
            header, payload = unpack_frame(data)
            return {"type": "binary", "flags": header.flags, "stream_id": header.stream_id, "seq": header.seq,
                    "start_sample": header.start_sample, "payload": payload, "t": time.monotonic()}
        return json.loads(data)

    async def recv_until(self, pred, timeout: float = TIMEOUT) -> list:
        """Messages up to and including the first for which pred(msg) is true."""
        out = []
        deadline = time.monotonic() + timeout
        while True:
            m = await self.recv(max(0.01, deadline - time.monotonic()))
            out.append(m)
            if pred(m):
                return out

    async def expect(self, type_: str, timeout: float = TIMEOUT, **fields) -> dict:
        """The next JSON message of that type whose fields match (binary frames and others are skipped)."""
        msgs = await self.recv_until(lambda m: m.get("type") == type_ and all(m.get(k) == v for k, v in
                                                                             fields.items()), timeout)
        return msgs[-1]

    async def error(self, code: str, timeout: float = TIMEOUT) -> dict:
        msgs = await self.recv_until(lambda m: m.get("type") in ("error", "warning"), timeout)
        err = msgs[-1]
        assert err["code"] == code, err
        return err

    async def quiet(self, seconds: float) -> list:
        """Everything that arrives within `seconds`."""
        out = []
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return out
            try:
                out.append(await self.recv(left))
            except asyncio.TimeoutError:
                return out

    async def closed(self, timeout: float = TIMEOUT) -> tuple[int | None, str]:
        """Read until the server closes; (code, reason)."""
        try:
            while True:
                await asyncio.wait_for(self.ws.recv(), timeout)
        except ConnectionClosed:
            pass
        rcvd = getattr(self.ws.protocol, "close_rcvd", None)
        return (rcvd.code, rcvd.reason) if rcvd is not None else (self.ws.close_code, self.ws.close_reason or "")

    async def close(self) -> None:
        await self.ws.close()


async def speak_ctx(raw: Raw, cid: str, words: list[str], *, create: dict | None = None, close: bool = True,
                    event_id: str | None = None) -> dict:
    msg = {"type": "context.create", "context_id": cid, **(create or {})}
    if event_id:
        msg["event_id"] = event_id
    await raw.send(msg)
    created = await raw.expect("context.created", context_id=cid)
    for w in words:
        await raw.send({"type": "text", "context_id": cid, "text": w})
    if close:
        await raw.send({"type": "context.close", "context_id": cid})
    return created


async def collect(raw: Raw, cid: str, stream_id: int | None, timeout: float = TIMEOUT) -> dict:
    """Messages of one context (binary by stream id) until its end message; other contexts' messages are kept
    in 'others'."""
    out = {"packets": [], "json": [], "others": [], "end": None}
    deadline = time.monotonic() + timeout
    while True:
        m = await raw.recv(max(0.01, deadline - time.monotonic()))
        if m["type"] == "binary":
            (out["packets"] if m["stream_id"] == stream_id else out["others"]).append(m)
            continue
        if m.get("context_id") != cid:
            out["others"].append(m)
            continue
        out["json"].append(m)
        if m["type"] in ("context.done", "context.cancelled"):
            out["end"] = m
            return out
