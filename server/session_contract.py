"""What the parts of the WebSocket door may ask of a session (server.gateway.WsSession), as typing Protocols.

A context (server.ws_context) holds its session, but importing the session's class for its type hints made a module
circle: gateway -> ws_handlers -> ws_context -> gateway. It names this protocol instead, so imports run one way:
gateway -> ws_context -> session_contract -> runtime. (The runtime's own view of a session, DrainableSession, is in
server.runtime for the same reason.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from server.outqueue import OutQueue
    from server.runtime import Runtime


class WsSession(Protocol):
    """What a context asks of its session: its outbox, the runtime, and the two notices it sends back."""

    runtime: Runtime
    out: OutQueue

    def send(self, msg: dict) -> None: ...

    def check_unsent(self) -> None: ...

    # `ctx` is the calling WsContext; naming its class here would close the circle again.
    def context_ended(self, ctx: Any, reason: str) -> None: ...
