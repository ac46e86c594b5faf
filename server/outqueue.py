"""The outgoing side of one WebSocket: a FIFO of messages for the emit task, with its unsent-audio account.

Unsent audio (seconds queued or being written, not yet accepted by the transport) is what a slow reader makes
grow: past the session's `max_unsent_audio_s` the session closes with 4009 instead of buffering without bound.
A cancelled context's queued audio and `flushed` messages are purged (barge-in drops audio not yet sent);
`context.created` and errors are never purged, so per-context order always holds.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class OutItem:
    data: bytes | str | None = None  # ready to send
    render: Callable[[], str] | None = None  # built when it is written (e.g. context.done with its ttfa)
    owner: Any = None  # the context it belongs to, if any
    audio_s: float = 0.0
    purgeable: bool = False
    on_sent: Callable[[], None] | None = None
    close: tuple[int, str] | None = None  # a close request (code, reason) instead of a message


class OutQueue:
    def __init__(self) -> None:
        self._q: deque[OutItem] = deque()
        self._wake = asyncio.Event()
        self.unsent_s = 0.0

    def __len__(self) -> int:
        return len(self._q)

    def put(self, item: OutItem, *, front: bool = False) -> None:
        if front:
            self._q.appendleft(item)
        else:
            self._q.append(item)
        self.unsent_s += item.audio_s
        self._wake.set()

    async def get(self) -> OutItem:
        while not self._q:
            self._wake.clear()
            await self._wake.wait()
        return self._q.popleft()

    def sent(self, item: OutItem) -> None:
        self.unsent_s = max(0.0, self.unsent_s - item.audio_s)

    def purge(self, owner: Any = None) -> int:
        """Drop the purgeable items of `owner` (None: everything that is not a close request)."""
        keep: deque[OutItem] = deque()
        dropped = 0
        for it in self._q:
            if (owner is None and it.close is None) or (owner is not None and it.owner is owner and it.purgeable):
                self.unsent_s = max(0.0, self.unsent_s - it.audio_s)
                dropped += 1
            else:
                keep.append(it)
        self._q = keep
        return dropped
