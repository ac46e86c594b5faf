"""Resource bounds per client (issue 10, items 4, 9, 10): every outgoing byte of a socket is bounded (a client
that does not read is closed with 4009), a cancel costs O(1) whatever the socket's backlog, a socket's message
rate is paced without holding other sockets up, and slow or greedy HTTP clients cannot hold connections."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from live_server import CONFIGS, Raw, run, start_server
from websockets.exceptions import ConnectionClosed

from server.ws.outbox import OutItem, OutQueue

LIMITS = ["--max-unsent-bytes", str(1 << 20), "--max-messages-per-s", "50", "--message-burst", "20",
          "--http-head-timeout-s", "1", "--http-body-timeout-s", "1", "--max-connections-per-client", "12",
          "--http-keepalive-s", "2.5"]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    s = start_server(tiny_checkpoint, [*CONFIGS["default"], *LIMITS])
    yield s
    s.stop()


# ------------------------------------------------------------------------------------------ the outgoing FIFO


def test_purge_drops_only_the_owner_and_keeps_the_account_exact():
    async def go():
        q = OutQueue()
        a, b = object(), object()
        q.put(OutItem(b"a1", owner=a, audio_s=0.5, purgeable=True))
        q.put(OutItem("created-b", owner=b))  # not purgeable: survives any purge
        q.put(OutItem(b"b1" * 10, owner=b, audio_s=1.0, purgeable=True))
        q.put(OutItem(b"a2", owner=a, audio_s=0.5, purgeable=True))
        assert q.unsent_bytes == 2 + 9 + 20 + 2 and q.unsent_s == 2.0
        first = await q.get()  # a1 is being written when a is cancelled
        assert first.data == b"a1"
        assert q.purge(a) == 2 and q.purge(a) == 0
        q.sent(first)
        assert q.unsent_s == 1.0 and q.unsent_bytes == 9 + 20 and len(q) == 2
        got = [await q.get(), await q.get()]
        assert [it.data for it in got] == ["created-b", b"b1" * 10]
        for it in got:
            q.sent(it)
        assert q.unsent_s == 0.0 and q.unsent_bytes == 0 and len(q) == 0

    asyncio.run(go())


def test_cancel_is_o1_whatever_the_backlog():
    """20,000 contexts each with one queued packet, cancelled one by one: a scan per cancel would take minutes."""
    q = OutQueue()
    owners = [object() for _ in range(20_000)]
    for o in owners:
        q.put(OutItem(b"x" * 100, owner=o, audio_s=0.02, purgeable=True))
    t0 = time.perf_counter()
    for o in owners:
        q.purge(o)
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0, elapsed
    assert len(q) == 0 and q.unsent_bytes == 0 and len(q._q) < 100  # compacted: dropped items hold no memory


# ------------------------------------------------------------------------------------------ WebSocket


def test_a_client_that_never_reads_is_closed_4009(server):
    """Item 9: pings with 60 KB ids and no reading grew the server by GBs; now 1 MiB unsent closes with 4009."""

    async def go():
        raw = await Raw.open(server.ws_url, max_queue=1)
        big = "x" * 60_000
        sent = 0
        with pytest.raises(ConnectionClosed):
            while sent < 2000:  # up to 120 MB if nothing bounded it
                await asyncio.wait_for(raw.send({"type": "ping", "id": big}), 15)
                sent += 1
                await asyncio.sleep(0)
            raise AssertionError("the server kept accepting pings from a client that never reads")
        assert sent * 60_000 < 40 << 20, sent
        return raw

    run(go(), timeout=120)
    log = server.log_text()
    assert "bytes unsent" in log and "closing with 4009" in log


def test_message_rate_is_paced_and_other_sockets_do_not_wait(server):
    """Item 10: 20 messages at once pass, the rest at 50/s; another socket's ping is answered at once meanwhile."""

    async def go():
        flood, other = await Raw.open(server.ws_url), await Raw.open(server.ws_url)
        t0 = time.monotonic()
        for i in range(70):
            await flood.send({"type": "ping", "id": i})
        await asyncio.sleep(0.3)
        t1 = time.monotonic()
        await other.send({"type": "ping", "id": "other"})
        assert (await other.expect("pong"))["id"] == "other"
        other_rtt = time.monotonic() - t1
        ids = [(await flood.expect("pong"))["id"] for _ in range(70)]
        flood_s = time.monotonic() - t0
        await flood.close()
        await other.close()
        return ids, flood_s, other_rtt

    ids, flood_s, other_rtt = run(go())
    assert ids == list(range(70))  # paced, never dropped or reordered
    assert flood_s >= 0.9, flood_s  # 50 messages past the burst at 50/s
    assert other_rtt < 0.5, other_rtt


# ------------------------------------------------------------------------------------------ HTTP connections


def open_conn(server, data: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    if data:
        s.sendall(data)
    return s


def read_all(s: socket.socket, timeout: float = 10.0) -> tuple[bytes, float]:
    """Everything until the server closes, and how long that took."""
    t0, out = time.monotonic(), b""
    s.settimeout(timeout)
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return out, time.monotonic() - t0


HEAD = b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def test_slow_heads_and_bodies_time_out(server):
    """Item 4: a head that never ends, a body that stops, and a chunked body that never ends held their
    connections for ever; now the head deadline (1 s here) closes the first and the others are 408."""
    loris = open_conn(server, HEAD[:30])
    slow_body = open_conn(server, HEAD + b"Content-Length: 100\r\n\r\n" + b'{"input": "')
    endless = open_conn(server, HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"in\"\r\n")
    data, took = read_all(loris)
    assert data == b"" and took < 5, (data, took)
    for s in (slow_body, endless):
        data, took = read_all(s)
        assert data.startswith(b"HTTP/1.1 408") and b"request_timeout" in data and took < 5, (data, took)


def read_response(s: socket.socket) -> bytes:
    """One whole response with a Content-Length body (b"" if the server closed instead)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def test_kept_alive_connections_idle_for_the_keepalive_time_not_the_head_deadline(server):
    """A W1 run lost one request of 5974 unsent (the client's ReadError): the server closed idle connections after
    5 s, the same moment httpx's pool expires them. Now idle kept-alive connections last --http-keepalive-s (2.5 s
    here), the head deadline (1 s) does not cut them, and past it the server closes them cleanly."""
    s = open_conn(server)
    get = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    s.sendall(get)
    assert read_response(s).startswith(b"HTTP/1.1 200")
    time.sleep(1.6)  # past the head deadline, within the keep-alive time
    s.sendall(get)
    assert read_response(s).startswith(b"HTTP/1.1 200")
    data, took = read_all(s)  # idle now: the server closes after 2.5 s, without a reset
    assert data == b"" and 2.0 < took < 6.0, (data, took)


def test_connections_per_client_are_capped(server):
    held = [open_conn(server) for _ in range(12)]
    try:
        time.sleep(0.2)
        data, took = read_all(open_conn(server))
        assert data.startswith(b"HTTP/1.1 429") and b"rate_limited" in data and took < 2, data
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)  # released: a new connection is served
    s = open_conn(server, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert read_all(s)[0].startswith(b"HTTP/1.1 200")
