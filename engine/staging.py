"""Host -> device inputs of a step without allocations or waits: one pinned ring, and several tensors in one copy.

Each step sends a handful of small tensors (slots, frames, prompt tokens, sampling settings). Pinning each one
(`Tensor.pin_memory()`) goes through the caching host allocator every time, and each copy is a launch of its own,
on a newcomer's path to first audio while the device waits for the host. Here the host writes every tensor of a
step into one 8-byte-aligned block of a preallocated pinned ring and the device receives the block in one copy.

A block is reused only once the copy out of it has completed: the runner tags the blocks a step took with that
step's end event (`seal`), and `take` waits for a block's event only if the ring has come round to it while it is
still in flight (in practice it never is: the ring holds many steps). On the CPU there is nothing to pin or wait for.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

ALIGN = 8  # bytes: every tensor starts aligned for int64 and float64 views


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class PackLayout:
    """Where each of several tensors (dtype, shape) sits in one byte block: `offsets[i]`, `total` bytes."""

    def __init__(self, specs: list[tuple[torch.dtype, tuple[int, ...]]]):
        self.specs = specs
        self.offsets, at = [], 0
        for dtype, shape in specs:
            self.offsets.append(at)
            at += _aligned(math.prod(shape) * dtype.itemsize)
        self.total = max(at, ALIGN)

    @classmethod
    def of(cls, tensors: list[Tensor]) -> PackLayout:
        return cls([(t.dtype, tuple(t.shape)) for t in tensors])

    def views(self, block: Tensor) -> list[Tensor]:
        """The tensors as views of `block` (uint8, at least `total` bytes, on any device)."""
        out = []
        for (dtype, shape), at in zip(self.specs, self.offsets, strict=True):
            n = math.prod(shape) * dtype.itemsize
            out.append(block[at:at + n].view(dtype).view(shape))
        return out


class HostStaging:
    """A ring of pinned host memory (CUDA) or plain memory (CPU) that step inputs are written into, in segments:
    blocks are cut from one segment after the other, and before the ring comes back to a segment the host makes
    sure the last step that read from it has ended (its event; long done unless the ring is tiny)."""

    def __init__(self, device: torch.device, segments: int = 16, segment_bytes: int = 256 << 10,
                 ring: bool | None = None):
        """ring: cut blocks from the ring (default: on a CUDA device; on the CPU a fresh block each time, as a copy
        there is done when it returns)."""
        self.device = device
        self.pinned = device.type == "cuda"
        self.use_ring = self.pinned if ring is None else ring
        self.segment_bytes = segment_bytes
        self.ring = torch.empty(segments * segment_bytes if self.use_ring else 0, dtype=torch.uint8,
                                pin_memory=self.pinned)
        # per segment, per device stream: the end event of the last step on that stream reading from it (a stream's
        # events complete in order, so the last one covers the ones before)
        self.events: list[dict[object, object]] = [{} for _ in range(segments)]
        self.segment, self.head = 0, 0  # the segment blocks are cut from, and the next free byte in it
        self.touched: set[int] = set()  # segments written since the last seal

    def take(self, nbytes: int) -> Tensor:
        """A uint8 block of at least `nbytes` that no copy still in flight reads."""
        n = _aligned(nbytes)
        if not self.use_ring or n > self.segment_bytes:  # (a very large prefill: pinned on its own)
            return torch.empty(n, dtype=torch.uint8, pin_memory=self.pinned)
        if self.head + n > self.segment_bytes:
            self.segment = (self.segment + 1) % len(self.events)
            self.head = 0
            for event in self.events[self.segment].values():
                event.synchronize()  # the ring came round to a segment a step may still read (long done in practice)
            self.events[self.segment].clear()
        at = self.segment * self.segment_bytes + self.head
        self.head += n
        self.touched.add(self.segment)
        return self.ring[at:at + n]

    def seal(self, event, stream: object = None) -> None:
        """The blocks taken since the last seal are read by copies enqueued before `event` (a step's end event,
        recorded on `stream`)."""
        for segment in self.touched:
            self.events[segment][stream] = event
        self.touched.clear()

    def upload(self, hosts: list[Tensor]) -> list[Tensor]:
        """Host tensors -> device tensors of the same dtypes and shapes, through one block and one copy."""
        layout = PackLayout.of(hosts)
        block = self.take(layout.total)
        for view, host in zip(layout.views(block), hosts, strict=True):
            view.copy_(host)
        return layout.views(block.to(self.device, non_blocking=True))
