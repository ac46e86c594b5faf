"""Resource bounds per client (issue 10, items 4, 9, 10): every outgoing byte of a socket is bounded (a client
that does not read is closed with 4009), a cancel costs O(1) whatever the socket's backlog, a socket's message
rate is paced without holding other sockets up, and slow or greedy HTTP clients cannot hold connections."""

from __future__ import annotations

import asyncio
import time

import pytest
from live_server import CONFIGS, Raw, run, start_server
from websockets.exceptions import ConnectionClosed

from server.outqueue import OutItem, OutQueue

LIMITS = ["--max-unsent-bytes", str(1 << 20), "--max-messages-per-s", "50", "--message-burst", "20"]


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
