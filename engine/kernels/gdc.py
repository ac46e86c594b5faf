"""Device-side halves of programmatic dependent launch (engine/kernels/__init__.py decides where it is on).

A kernel launched as a programmatic dependent may start while the kernel before it on the stream still runs. So
every such kernel calls `wait_inputs` before it writes anything or reads anything an earlier kernel wrote; only
then does it let the next kernel launch, so at most two kernels overlap and each waits for the one before (which
waited for its own): the order of writes is the stream's order. Reads of constants (weights) may come before
the wait: `prefetch_l2` pulls them into L2 meanwhile. With GDC False both are no-ops, so the same kernels run in
triton's interpreter and on GPUs without PDL.
"""

from __future__ import annotations

import triton
import triton.language as tl

L2_LINE_BYTES = 128


@triton.jit
def wait_inputs(GDC: tl.constexpr):
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """A hint, one per pointer: bring the line holding each address into L2 (no registers filled, no fault)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
