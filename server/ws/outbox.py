"""The outgoing side of one WebSocket: a FIFO of messages for the emit task, with its unsent account and bounds.

Unsent (queued or being written, not yet accepted by the transport) is what a client that does not read makes
grow. Both the seconds of audio and the bytes of every message are counted: past the session's
`max_unsent_audio_s` or `max_unsent_bytes` the session closes with 4009 instead of buffering without bound.

A cancelled context's queued audio and `flushed` messages are purged (barge-in drops audio not yet sent) in
O(1): each context's purgeable items share one account, and purging marks the account; the emit task skips
marked items as it meets them, and the FIFO is compacted once dropped items outnumber live ones (amortised O(1)
per item, and dropped items never hold more memory than live ones). `context.created` and errors are never
purged, so per-context order always holds.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.config import Limits
    from server.metrics import ServerMetrics

RENDERED_BYTES = 512  # what a message built when written (context.done) is counted as until then
MIN_COMPACT = 64  # dropped items tolerated before the FIFO is compacted


class Account:
    """The purgeable items of one owner still queued: how many, their audio and bytes; `dropped` once purged."""

    __slots__ = ("items", "audio_s", "bytes", "dropped")

    def __init__(self) -> None:
        self.items, self.audio_s, self.bytes, self.dropped = 0, 0.0, 0, False


@dataclass(eq=False)
class OutItem:
    data: bytes | str | None = None  # ready to send
    render: Callable[[], str] | None = None  # built when it is written (e.g. context.done with its ttfa)
    owner: Any = None  # the context it belongs to, if any
    audio_s: float = 0.0
    purgeable: bool = False
    on_sent: Callable[[], None] | None = None
    close: tuple[int, str] | None = None  # a close request (code, reason) instead of a message
    size: int = 0  # bytes counted (set by the queue)
    account: Account | None = None  # set by the queue for purgeable items of an owner

    @property
    def dropped(self) -> bool:
        return self.account is not None and self.account.dropped


class OutQueue:
    def __init__(self) -> None:
        self._q: deque[OutItem] = deque()
        self._wake = asyncio.Event()
        self._accounts: dict[Any, Account] = {}
        self._dropped = 0  # purged items still in the FIFO
        self._writing: OutItem | None = None  # returned by get(), not yet sent()
        self.unsent_s = 0.0
        self.unsent_bytes = 0

    def __len__(self) -> int:
        return len(self._q) - self._dropped

    def put(self, item: OutItem, *, front: bool = False) -> None:
        item.size = len(item.data) if item.data is not None else (RENDERED_BYTES if item.render else 0)
        if item.purgeable and item.owner is not None:
            acc = self._accounts.setdefault(item.owner, Account())
            acc.items += 1
            acc.audio_s += item.audio_s
            acc.bytes += item.size
            item.account = acc
        if front:
            self._q.appendleft(item)
        else:
            self._q.append(item)
        self.unsent_s += item.audio_s
        self.unsent_bytes += item.size
        self._wake.set()

    async def get(self) -> OutItem:
        while True:
            while not self._q:
                self._wake.clear()
                await self._wake.wait()
            item = self._q.popleft()
            if not item.dropped:
                self._writing = item
                return item
            self._dropped -= 1

    def sent(self, item: OutItem) -> None:
        """`item` (returned by get) is written, or given up: it no longer counts."""
        if self._writing is item:
            self._writing = None
        if item.dropped:
            return  # its purge took it off the account already
        self.unsent_s = max(0.0, self.unsent_s - item.audio_s)
        self.unsent_bytes = max(0, self.unsent_bytes - item.size)
        acc = item.account
        if acc is not None:
            acc.items -= 1
            acc.audio_s -= item.audio_s
            acc.bytes -= item.size
            if acc.items <= 0 and self._accounts.get(item.owner) is acc:
                del self._accounts[item.owner]

    def purge(self, owner: Any = None) -> int:
        """Drop the purgeable items of `owner` (O(1)), or with None everything that is not a close request."""
        if owner is None:
            dropped = len(self)
            self._q = deque(it for it in self._q if it.close is not None)
            for acc in self._accounts.values():
                acc.dropped = True
            self._accounts.clear()
            self._dropped = 0
            self.unsent_s, self.unsent_bytes = 0.0, 0
            return dropped
        acc = self._accounts.pop(owner, None)
        if acc is None:
            return 0
        acc.dropped = True
        self.unsent_s = max(0.0, self.unsent_s - acc.audio_s)
        self.unsent_bytes = max(0, self.unsent_bytes - acc.bytes)
        writing = self._writing is not None and self._writing.account is acc
        self._dropped += acc.items - writing  # the item being written is no longer in the FIFO
        if self._dropped > max(MIN_COMPACT, len(self._q) - self._dropped):
            self._q = deque(it for it in self._q if not it.dropped)
            self._dropped = 0
        return acc.items


class Outbox(OutQueue):
    """The session's outgoing FIFO as the session and its contexts write to it: `send` a JSON message, `put` an
    item; after either, a client that does not read is caught before what waits for it passes either unsent bound
    (`on_overflow(what, reason, message)` once, and the session closes with 4009). A context that ends says so
    with `context_ended` (the session forgets it). This is all a context holds of its session."""

    def __init__(self, limits: Limits, metrics: ServerMetrics, *, on_overflow: Callable[[str, str, str], None],
                 on_context_ended: Callable[[Any, str], None]) -> None:
        super().__init__()
        self.limits, self.metrics = limits, metrics
        self._on_overflow = on_overflow
        self.context_ended = on_context_ended  # context_ended(ctx, reason): the session forgets that context
        self.closed = False  # the session is ending: a close is queued or about to be

    def send(self, msg: dict) -> None:
        if msg.get("type") == "error":
            self.metrics.errors.inc("ws", msg["code"])
        self.put(OutItem(dumps(msg)))
        self.check_unsent()

    def check_unsent(self) -> None:
        if self.closed:
            return
        lim = self.limits
        if self.unsent_s > lim.max_unsent_audio_s:
            what = f"{self.unsent_s:.1f} s of audio unsent (limit {lim.max_unsent_audio_s:g} s)"
            reason = "slow reader: unsent audio over max_unsent_audio_s"
            message = (f"over {lim.max_unsent_audio_s:g} s of audio waited to be sent (limits.max_unsent_audio_s): "
                       "read faster")
        elif self.unsent_bytes > lim.max_unsent_bytes:
            what = f"{self.unsent_bytes} bytes unsent (limit {lim.max_unsent_bytes})"
            reason = "slow reader: unsent bytes over max_unsent_bytes"
            message = (f"over {lim.max_unsent_bytes} bytes waited to be sent (limits.max_unsent_bytes): read what "
                       "the server sends")
        else:
            return
        self.metrics.slow_readers.inc()
        self._on_overflow(what, reason, message)


def dumps(msg: dict) -> str:
    return json.dumps(msg, ensure_ascii=False, separators=(",", ":"))
