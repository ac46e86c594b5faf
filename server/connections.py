"""Connection-level guards uvicorn does not give: a deadline for each request head, and a cap on the open
connections of one client address.

Without them a slow-loris client (a head sent a byte at a time, or never finished) keeps its connection and file
descriptor for ever, and enough of them exhaust the process's open-file limit so new WebSocket connects fail.
The body deadline is enforced where the body is read (server/http/openai_api.py: 408 `request_timeout`).

`guarded_protocol(base, ...)` subclasses uvicorn's HTTP protocol class (httptools or h11; both keep `cycle`, the
request being served, and upgrade through `handle_websocket_upgrade`). A head is complete when a new request cycle
starts; a head deadline fires only if none has started since it was armed: at connect, and after each response
while the connection is kept alive, where it allows the keep-alive time first (uvicorn closes a connection idle
that long; a head deadline of its own there would cut idle kept-alive connections short, with a reset). An upgraded
connection belongs to the WebSocket layer and leaves both guards (its sessions have their own limits and timeouts).
"""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("voicelane.http")

REFUSED = (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nconnection: close\r\n"
           b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s")
REFUSED_BODY = (b'{"error":{"message":"too many open connections from this address (--max-connections-per-client)",'
                b'"type":"rate_limit_error","param":null,"code":"rate_limited"}}')


class ClientConnections:
    """Open connections per client address (shared by every protocol instance of one server)."""

    def __init__(self, cap: int):
        self.cap = cap  # 0 = unlimited
        self.open: Counter[str] = Counter()
        self.refused = 0

    def admit(self, address: str) -> bool:
        if self.cap and self.open[address] >= self.cap:
            self.refused += 1
            return False
        self.open[address] += 1
        return True

    def release(self, address: str) -> None:
        self.open[address] -= 1
        if self.open[address] <= 0:
            del self.open[address]


def guarded_protocol(base: type, connections: ClientConnections, head_timeout_s: float,
                     keepalive_s: float = 0.0) -> type:
    class Guarded(base):
        _address: str | None = None  # counted against the cap while set
        _refused = False
        _upgraded = False
        _head_timer = None

        def connection_made(self, transport) -> None:
            peer = transport.get_extra_info("peername")
            address = str(peer[0]) if isinstance(peer, tuple | list) and peer else "?"
            if not connections.admit(address):
                log.warning("client %s: over %d open connections: refused", address, connections.cap)
                self._refused = True
                transport.write(REFUSED % (len(REFUSED_BODY), REFUSED_BODY))
                transport.close()
                return
            self._address = address
            super().connection_made(transport)
            self._arm_head_deadline(head_timeout_s)

        def connection_lost(self, exc) -> None:
            self._leave_guards()
            if not self._refused:  # a refused connection never reached the base class
                super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # closing
            super().data_received(data)

        def handle_websocket_upgrade(self, *args) -> None:
            self._upgraded = True
            self._leave_guards()
            super().handle_websocket_upgrade(*args)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_deadline(keepalive_s + head_timeout_s)

        def _arm_head_deadline(self, seconds: float) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(seconds, self._head_deadline, self.cycle)

        def _head_deadline(self, cycle_when_armed) -> None:
            self._head_timer = None
            if self._upgraded or self.cycle is not cycle_when_armed or self.transport.is_closing():
                return  # a request head came in time (or the connection is gone)
            log.info("client %s: no complete request head within %g s: connection closed", self._address,
                     head_timeout_s)
            self.transport.abort()

        def _leave_guards(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            if self._address is not None:
                connections.release(self._address)
                self._address = None

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded
