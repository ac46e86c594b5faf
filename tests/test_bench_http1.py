"""The load generator's lean HTTP/1.1 client (bench/http1.py) against scripted servers: framing undone exactly
(chunked with extensions and trailers, Content-Length, close-delimited), body pieces as they arrive, keep-alive
reuse, and a broken response never reused."""

from __future__ import annotations

import asyncio

import pytest

from bench.http1 import Http1Error, Http1Pool


async def _serve(script):
    """A server whose every connection runs `script(reader, writer, request_number)` per request it reads."""
    count = [0]

    async def handler(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                count[0] += 1
                if not await script(writer, count[0]):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handler, "127.0.0.1", 0)
    return srv, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"


def _against(script, requests: int, expect_first: type[Exception] | None = None):
    """`requests` requests in a row through one pool to a server running `script`: their (status, headers,
    pieces), the first one expected to raise `expect_first` (then left out), and the connections opened."""
    async def go():
        srv, url = await _serve(script)
        pool = Http1Pool(url)
        try:
            results = []
            for i in range(requests):
                if i == 0 and expect_first is not None:
                    with pytest.raises(expect_first) as raised:
                        await _request(pool)
                    results.append(raised.value)
                    continue
                results.append(await _request(pool))
            return results, pool.opened
        finally:
            await pool.aclose()
            srv.close()

    return asyncio.run(go())


async def _request(pool: Http1Pool, body: bytes = b"{}"):
    conn = await pool.acquire()
    try:
        conn.send(pool.request_head("POST", "/v1/audio/speech", {"Content-Type": "application/json"}, body), body)
        resp = await conn.response_head()
        return resp.status, resp.headers, [p async for p in resp.pieces()]
    finally:
        pool.release(conn)


def test_chunked_body_in_pieces_with_extensions_and_trailers_and_the_connection_reused():
    async def script(writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Sample-Rate: 24000\r\n\r\n")
        writer.write(b"5;ext=1\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # the second chunk comes later: a piece of its own
        writer.write(b"6\r\n world\r\n0\r\nX-Trailer: yes\r\n\r\n")
        await writer.drain()
        return True

    ((status, headers, pieces), second), opened = _against(script, 2)
    assert status == 200 and headers["x-sample-rate"] == "24000"
    assert pieces == [b"hello", b" world"]
    assert second[2] == pieces and opened == 1  # kept alive: one connection for both


def test_content_length_body_and_connection_close_is_not_reused():
    async def script(writer, n):
        msg = b'{"error":"busy"}'
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(msg), msg))
        await writer.drain()
        return False

    results, opened = _against(script, 2)
    assert [(s, b"".join(p)) for s, _, p in results] == [(503, b'{"error":"busy"}')] * 2
    assert opened == 2


def test_a_response_cut_midway_raises_and_its_connection_is_dropped():
    async def script(writer, n):
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
            await writer.drain()
            return False  # closes the connection 91 bytes short
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        return True

    (error, (status, _, pieces)), opened = _against(script, 2, expect_first=Http1Error)
    assert "91 body bytes missing" in str(error)
    assert status == 200 and pieces == [b"ok"] and opened == 2


def test_only_plain_http():
    with pytest.raises(ValueError, match="plain http only"):
        Http1Pool("https://example.com")
