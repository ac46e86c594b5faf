"""engine/staging.py: step inputs packed into one block of a reused host ring; a block is written again only after
the step that read it has ended."""

from __future__ import annotations

import torch

from engine.staging import HostStaging, PackLayout


class _Event:
    """A step's end event as the ring sees it: done or not, and whether the host waited for it."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(self.name)


def test_upload_packs_mixed_dtypes_and_shapes_and_gives_them_back():
    staging = HostStaging(torch.device("cpu"), segments=2, segment_bytes=256, ring=True)
    hosts = [torch.tensor([3, 1, 4], dtype=torch.int64), torch.tensor([[True], [False]]),
             torch.tensor([[0.5, 1.5, 2.5]], dtype=torch.float32), torch.tensor([7], dtype=torch.int64)]
    out = staging.upload(hosts)
    for host, got in zip(hosts, out, strict=True):
        assert got.dtype == host.dtype and got.shape == host.shape and torch.equal(got, host)
    layout = PackLayout.of(hosts)
    assert all(at % 8 == 0 for at in layout.offsets) and layout.offsets == sorted(set(layout.offsets))


def test_blocks_of_in_flight_steps_are_never_handed_out_twice():
    """Blocks are cut one after the other; coming round to a segment waits for the last step of each stream that
    read it, and only then; a block never overlaps one a step still in flight reads."""
    log: list[str] = []
    staging = HostStaging(torch.device("cpu"), segments=2, segment_bytes=64, ring=True)
    a = staging.take(40)  # segment 0
    staging.seal(_Event(log, "step1"), stream="main")
    b = staging.take(40)  # does not fit beside a: segment 1
    staging.seal(_Event(log, "step2-first"), stream="first")
    staging.take(8)  # segment 1 still
    staging.seal(_Event(log, "step3-first"), stream="first")
    assert log == []  # nothing waited for yet
    assert a.data_ptr() + 40 <= b.data_ptr() or b.data_ptr() + 40 <= a.data_ptr()
    c = staging.take(64)  # round to segment 0: step 1 must have ended
    assert log == ["step1"] and c.data_ptr() == a.data_ptr()
    staging.seal(_Event(log, "step4"), stream="main")
    staging.take(64)  # round to segment 1: the last step of its stream that read it (step 3), nothing of main
    assert log == ["step1", "step3-first"]
    big = staging.take(1000)  # larger than a segment: a block of its own, outside the ring
    assert not (staging.ring.data_ptr() <= big.data_ptr() < staging.ring.data_ptr() + staging.ring.numel())
