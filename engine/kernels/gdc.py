"""Device-side halves of programmatic dependent launch (engine/kernels/__init__.py decides where it is on).

A kernel launched as a programmatic dependent may start while the kernel before it on the stream still runs. So
every such kernel calls `wait_inputs` before it writes anything or reads anything an earlier kernel wrote, and
each waits for the one before (which waited for its own): the order of writes is the stream's order. Reads of
constants (weights) may come before the wait: `prefetch_l2` pulls them into L2 meanwhile, or a preloading kernel
reads them into registers. GDC (engine/kernels/pdl.py's launch_options) says when the next kernel may launch:
- "after_wait" (GDC 1, pdl.TRIGGERS): once this kernel's inputs are ready, so at most two kernels overlap;
- "early" (GDC 2): at once, so the kernels after it launch while it still waits (each only once every program of the
  one before has started): their weight reads can run several kernels ahead of the data they multiply.
With GDC 0 (False) both calls are no-ops, so the same kernels run in triton's interpreter and on GPUs without PDL.
"""

from __future__ import annotations

import triton
import triton.language as tl

L2_LINE_BYTES = 128


@triton.jit
def wait_inputs(GDC: tl.constexpr):
    if GDC == 2:  # trigger early (pdl.TRIGGERS)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """A hint, one per pointer: bring the line holding each address into L2 (no registers filled, no fault)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
