"""Which lane (device stream) the kernels launched now belong to, for scratch that launches share.

A kernel's scratch shared across launches (the skinny GEMM's split-K tickets) is safe while its launches run one
after another on one stream. With two lanes (the engine's first-audio lane beside the main one) launches of the two
lanes run at the same time, so such scratch is kept per lane: the runner names the lane around each launch and each
graph capture.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_LANE: ContextVar[str | None] = ContextVar("voicelane_kernel_lane", default=None)


@contextmanager
def on_lane(name: str | None) -> Iterator[None]:
    token = _LANE.set(name)
    try:
        yield
    finally:
        _LANE.reset(token)


def current_lane() -> str | None:
    return _LANE.get()
