"""A lean HTTP/1.1 client for the load generator's W1 requests (plain http only).

Why not httpx, which the generator used before: BENCHMARK.md's dispatch is the moment the request's body leaves
the client, and first playable the moment the first sample arrives. httpx's own work (request building, its
pool, h11's state machine, the stream wrappers) falls between those moments and the clock: against a server that
answers at once, a round trip to the first body bytes took 0.89 ms at p50 through httpx and 0.16 ms here (this
repository's 2-core CPU machine, 200 requests each). Here the clock is read right before the request's bytes are
written to the socket, and each body piece is stamped as the socket hands it over.

Connections are kept alive and reused; a new one is opened before dispatch, never inside the timed span (a
WebSocket is opened before dispatch too). A response is read to its end before its connection is reused; a
request that fails or is cancelled midway closes its connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

READ_SIZE = 1 << 16


class Http1Error(ConnectionError):
    """The server broke the HTTP/1.1 framing or closed the connection mid-response."""


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # lower-case names
    conn: Connection = field(repr=False)

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as the socket delivers it (chunked or Content-Length framing undone), piece by piece."""
        async for piece in self.conn.body(self.headers):
            yield piece

    async def read(self) -> bytes:
        return b"".join([p async for p in self.pieces()])


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.reusable = False  # set once a response has been read to its end on a keep-alive connection

    def send(self, head: bytes, body: bytes) -> None:
        """Hand the whole request to the socket in one write (asyncio tries the send at once)."""
        self.reusable = False
        self.writer.write(head + body)

    async def response_head(self) -> Response:
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise Http1Error(f"bad status line {lines[0]!r}")
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        return Response(int(parts[1]), headers, self)

    async def body(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await self.reader.readuntil(b"\r\n")
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    while await self.reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
                        pass
                    break
                async for piece in self._exactly(size):
                    yield piece
                if await self.reader.readexactly(2) != b"\r\n":
                    raise Http1Error("chunk not followed by CRLF")
        elif "content-length" in headers:
            async for piece in self._exactly(int(headers["content-length"])):
                yield piece
        else:  # the body ends with the connection
            while piece := await self.reader.read(READ_SIZE):
                yield piece
            return
        self.reusable = headers.get("connection", "").lower() != "close"

    async def _exactly(self, n: int) -> AsyncIterator[bytes]:
        while n > 0:
            piece = await self.reader.read(min(n, READ_SIZE))
            if not piece:
                raise Http1Error(f"connection closed with {n} body bytes missing")
            n -= len(piece)
            yield piece

    def close(self) -> None:
        self.writer.close()


class Http1Pool:
    """Keep-alive connections to the host of `base_url`; `request_head` lays out a request for it."""

    def __init__(self, base_url: str):
        url = urlsplit(base_url)
        if url.scheme != "http":
            raise ValueError(f"the lean HTTP client speaks plain http only, not {url.scheme!r}: use --http-client "
                             "httpx")
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.netloc = url.netloc
        self.idle: list[Connection] = []
        self.opened = 0

    async def acquire(self) -> Connection:
        while self.idle:
            conn = self.idle.pop()
            if not conn.writer.is_closing() and not conn.reader.at_eof():
                return conn
            conn.close()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        self.opened += 1
        return Connection(reader, writer)

    def release(self, conn: Connection) -> None:
        if conn.reusable and not conn.writer.is_closing():
            self.idle.append(conn)
        else:
            conn.close()

    def request_head(self, method: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.netloc}", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def aclose(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()
