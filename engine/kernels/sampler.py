"""Fused token sampler (Triton): one program per row picks that row's token in one pass over its logits.

It makes the same choice as the PyTorch reference `engine.model.sampling.choose` (after
`process_talker_logits` when Talker rules are given), with the same counter-hash seeds:

- the Talker's rules (repetition penalty, code-0 suppression, EOS masked before min_frames) applied in registers;
- greedy rows (temperature 0) take the first maximal logit;
- sampled rows divide by their temperature (IEEE division, as torch does), keep the scores >= the k-th largest
  (found by a radix select over order-preserving integer keys, not a sort, that stops once the k-th is
  pinned), then, only for rows with top_p < 1, keep the scores whose strictly-greater probability mass is
  below top_p (a 32-step search over the same keys); the survivors are packed into a per-row scratch list and
  only they get Gumbel noise: the same 32-bit hash, uniform and float64 double log as `gumbel_noise`, rounded
  to float32 and added to the score; the first maximal sum wins, as torch's argmax.
- NaN logits count as -inf (never chosen while a finite one exists). The reference would pick a NaN itself;
  such rows fail as "non-finite" in the runner either way, the kernel only promises an id in [0, V).

Where they can differ from the reference: the top-p boundary when a token's mass above sits within float
rounding of top_p (torch sums a sorted cumulative sum, the kernel a tree sum). Top-k, temperature and the
noise are exact.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from engine.kernels.pdl import launch_options

log = logging.getLogger("voicelane.kernels.sampler")

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # CPU-only installs: the PyTorch reference serves, kernels_status() says why
    triton, tl = None, None
    _IMPORT_ERROR: str | None = f"triton is not importable: {exc}"
else:
    from engine.kernels.gdc import wait_inputs

    _IMPORT_ERROR = None

# The launch configuration, chosen by measurement on the H200 (engine.tools.gpu_check_sampler times the variants
# inside a CUDA graph, as the engine runs them).
DIGIT_BITS = 4  # radix-select digit: 16 bins a pass are far cheaper than 256 in Triton's ballot histogram
THREADS_PER_WARP = 32


def num_warps_for(block: int) -> int:
    """In a CUDA graph on the H200 (d222cdb, t0.9 k50): V 2048 B1 7.9-8.8 us a draw at 8 warps (4: 9.1-10.0),
    V 3072 with the Talker's rules 14.2 us at 16 (8: 16.4); B64 likewise."""
    return 8 if block <= 2048 else 16


def kernels_status() -> dict:
    """For readiness: whether the fused sampler can run on a GPU here, and why not."""
    if _IMPORT_ERROR is not None:
        return {"fused_sampler": False, "reason": _IMPORT_ERROR}
    return {"fused_sampler": True, "triton": triton.__version__}


def available() -> bool:
    return _IMPORT_ERROR is None


if triton is not None:

    @triton.jit
    def _mix(x):
        """engine.model.sampling._hash32 on uint32 (its & 0xFFFFFFFF is the uint32 wrap-around)."""
        x = (x ^ (x >> 16)) * 0x45D9F3B
        x = (x ^ (x >> 16)) * 0x45D9F3B
        return x ^ (x >> 16)

    @triton.jit
    def _row_hash(seed, counter):
        """The per-row half of _hash_bits: seed, counter int64 scalars -> uint32."""
        h = _mix(seed.to(tl.uint32))
        h = _mix(h ^ (seed >> 32).to(tl.uint32))
        return _mix(h ^ counter.to(tl.uint32))

    @triton.jit
    def _gumbel(h, cols):
        """gumbel_noise for the given columns: float64 uniform strictly inside (0, 1), never +inf, as float32."""
        bits = _mix(h + cols.to(tl.uint32) * 0x9E3779B1)
        u = (bits.to(tl.float64) + 0.5) * 2.3283064365386963e-10  # / 2**32, exact
        return (-tl.log(-tl.log(u))).to(tl.float32)

    @triton.jit
    def _order_key(x):
        """float32 -> uint32 whose unsigned order is the float order (NaN-free input)."""
        bits = x.to(tl.uint32, bitcast=True)
        return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)

    @triton.jit
    def _key_value(key):
        bits = tl.where((key >> 31) != 0, key & 0x7FFFFFFF, key ^ 0xFFFFFFFF)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _kth_largest_key(key, valid, k, DIGIT_BITS: tl.constexpr):
        """The k-th largest of the valid keys (1 <= k <= their count): radix select from the top, DIGIT_BITS bits
        a pass. It stops as soon as the k-th is the smallest or the largest of the keys still tied with it on the
        digits so far (usually after two or three passes), and takes it with one reduction."""
        BINS: tl.constexpr = 1 << DIGIT_BITS
        bins = tl.arange(0, BINS)
        live = valid
        remaining = k
        result = tl.full([], 0, tl.uint32)
        shift = 32 - DIGIT_BITS
        while shift >= 0:
            digits = ((key >> shift.to(tl.uint32)) & (BINS - 1)).to(tl.int32)
            hist = tl.histogram(digits, BINS, mask=live)  # [BINS]
            at_least = tl.cumsum(hist, axis=0, reverse=True)  # live keys whose digit >= bin
            digit = tl.sum((at_least >= remaining).to(tl.int32), axis=0) - 1
            remaining -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
            tied = tl.sum(tl.where(bins == digit, hist, 0), axis=0)
            live = live & (digits == digit)
            if (tied == remaining) | (remaining == 1) | (shift == 0):
                lowest = tl.min(tl.where(live, key, tl.full([], 0xFFFFFFFF, tl.uint32)), axis=0)
                highest = tl.max(tl.where(live, key, tl.full([], 0, tl.uint32)), axis=0)
                result = tl.where(tied == remaining, lowest, highest)
                shift = -1
            else:
                shift -= DIGIT_BITS
        return result

    @triton.jit
    def _nucleus_key(score, key, keep, top_p):
        """Smallest key whose kept probability mass strictly above it is < top_p (keys >= it stay)."""
        top = tl.max(tl.where(keep, score, float("-inf")), axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)
        e = tl.where(keep, tl.exp(score - top), 0.0)
        prob = tl.math.div_rn(e, tl.sum(e, axis=0))
        below = tl.full([], 0, tl.uint32)  # largest key found so far whose mass above is still >= top_p
        for b in tl.static_range(32):
            trial = below | (1 << (31 - b))
            mass = tl.sum(tl.where(key > trial, prob, 0.0), axis=0)
            below = tl.where(mass >= top_p, trial, below)
        mass = tl.sum(tl.where(key > below, prob, 0.0), axis=0)
        return tl.where(mass >= top_p, below + 1, 0)

    @triton.jit
    def _sample_rows(logits_ptr, logits_stride, out_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr,
                     counter_ptr, counter_stride, seen_ptr, seen_stride, penalty_ptr, allow_eos_ptr, suppress_ptr,
                     eos_id, scratch_col_ptr, scratch_val_ptr, V,
                     TALKER: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, DIGIT_BITS: tl.constexpr,
                     GDC: tl.constexpr):
        wait_inputs(GDC)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        valid = cols < V
        x = tl.load(logits_ptr + row * logits_stride + cols, mask=valid, other=float("-inf")).to(tl.float32)
        x = tl.where(x == x, x, float("-inf"))
        if TALKER:  # process_talker_logits: penalty on seen ids, then suppression and EOS before min_frames
            seen = tl.load(seen_ptr + row * seen_stride + cols, mask=valid, other=0) != 0
            penalty = tl.load(penalty_ptr + row)
            x = tl.where(seen, tl.where(x < 0, x * penalty, tl.math.div_rn(x, penalty)), x)
            blocked = tl.load(suppress_ptr + cols, mask=valid, other=0) != 0
            eos_closed = tl.load(allow_eos_ptr + row) == 0
            blocked = blocked | ((cols == eos_id) & eos_closed)
            x = tl.where(blocked, float("-inf"), x)

        temperature = tl.load(temperature_ptr + row)
        if temperature > 0:
            score = tl.math.div_rn(x, temperature)
            key = _order_key(score)
            top_k = tl.load(top_k_ptr + row)
            k = tl.minimum(tl.maximum(tl.where(top_k > 0, top_k, V), 1), V).to(tl.int32)
            keep = valid
            if k < V:
                kth = _key_value(_kth_largest_key(key, valid, k, DIGIT_BITS))
                keep = valid & (score >= kth)
            top_p = tl.load(top_p_ptr + row)
            if top_p < 1.0:
                keep = keep & (key >= _nucleus_key(score, key, keep, top_p))

            # Pack the survivors (in column order, so ties still go to the lowest column) and noise only them.
            count = tl.sum(keep.to(tl.int32), axis=0)
            rank = tl.cumsum(keep.to(tl.int32), axis=0) - 1
            base = row * BLOCK
            tl.store(scratch_col_ptr + base + rank, cols, mask=keep)
            tl.store(scratch_val_ptr + base + rank, score, mask=keep)
            tl.debug_barrier()  # the packed list is read back by other threads of this program

            h = _row_hash(tl.load(seed_ptr + row), tl.load(counter_ptr + row * counter_stride))
            lane = tl.arange(0, CHUNK)
            best = tl.full([], float("-inf"), tl.float32)
            choice = tl.full([], 0, tl.int32)
            start = count * 0
            while start < count:  # (a while loop: the interpreter cannot range() over a reduced count)
                live = start + lane < count
                c = tl.load(scratch_col_ptr + base + start + lane, mask=live, other=0)
                s = tl.load(scratch_val_ptr + base + start + lane, mask=live, other=float("-inf"))
                total = tl.where(live, s + _gumbel(h, c), float("-inf"))
                top = tl.max(total, axis=0)
                at = tl.argmax(total, axis=0)
                col = tl.sum(tl.where(lane == at, c, 0), axis=0)
                choice = tl.where(top > best, col, choice)
                best = tl.maximum(best, top)
                start += CHUNK
        else:
            choice = tl.argmax(x, axis=0).to(tl.int32)
        tl.store(out_ptr + row, choice.to(tl.int64))


class SamplerInputError(ValueError):
    """Tensors handed to the fused sampler have the wrong shape, dtype or layout."""


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise SamplerInputError(what)


def _rows_check(name: str, t: Tensor, B: int, dtype: torch.dtype) -> None:
    _need(t.dim() == 1 and t.shape[0] == B and t.dtype == dtype,
          f"{name}: expected [{B}] {dtype}, got {list(t.shape)} {t.dtype}")


def check_inputs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, counter: Tensor,
                 talker: tuple[Tensor, Tensor, Tensor, Tensor, int] | None = None) -> None:
    """Raise SamplerInputError unless the arguments fit fused_sample (shapes, dtypes and layout only: host side)."""
    _need(_IMPORT_ERROR is None, _IMPORT_ERROR or "")
    _need(logits.dim() == 2 and logits.stride(1) == 1 and logits.dtype in (torch.float32, torch.bfloat16,
                                                                            torch.float16),
          f"logits: expected [B, V] float with contiguous columns, got {list(logits.shape)} {logits.dtype}")
    B, V = logits.shape
    for name, t, dtype in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int64),
                           ("top_p", top_p, torch.float32), ("seed", seed, torch.int64),
                           ("counter", counter, torch.int64)):
        _rows_check(name, t, B, dtype)
    _need(temperature.is_contiguous() and top_k.is_contiguous() and top_p.is_contiguous() and seed.is_contiguous(),
          "temperature, top_k, top_p, seed: expected contiguous")
    if talker is not None:
        seen, penalty, allow_eos, suppress, eos_id = talker
        _need(seen.shape == (B, V) and seen.dtype == torch.bool and seen.stride(1) == 1,
              f"seen: expected [{B}, {V}] bool with contiguous columns, got {list(seen.shape)} {seen.dtype}")
        _rows_check("penalty", penalty, B, torch.float32)
        _rows_check("allow_eos", allow_eos, B, torch.bool)
        _need(suppress.shape == (V,) and suppress.dtype == torch.bool, f"suppress: expected [{V}] bool")
        _need(0 <= eos_id < V, f"eos_id {eos_id} outside [0, {V})")


def scratch(B: int, V: int, device) -> tuple[Tensor, Tensor]:
    """The per-row survivor lists the kernel packs (columns, scores); reusable by later launches on the stream."""
    block = triton.next_power_of_2(V)
    return (torch.empty(B, block, dtype=torch.int32, device=device),
            torch.empty(B, block, dtype=torch.float32, device=device))


def launch(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, counter: Tensor,
           talker: tuple[Tensor, Tensor, Tensor, Tensor, int] | None, space: tuple[Tensor, Tensor],
           digit_bits: int | None = None, num_warps: int | None = None) -> Tensor:
    """fused_sample without the checks (callers that checked once, e.g. the Code Predictor's 15 draws).
    digit_bits (2, 4 or 8) and num_warps override the measured launch configuration (for the GPU check)."""
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    if talker is not None:
        seen, penalty, allow_eos, suppress, eos_id = talker
        seen_stride = seen.stride(0)
    else:
        seen = penalty = allow_eos = suppress = logits  # never read: TALKER is a compile-time False
        eos_id, seen_stride = 0, 0
    block = space[0].shape[1]
    warps = num_warps or num_warps_for(block)
    # Survivors are noised one chunk a loop step, one per thread: a top-k of 50 is one step.
    _sample_rows[(B,)](logits, logits.stride(0), out, temperature, top_k, top_p, seed, counter, counter.stride(0),
                       seen, seen_stride, penalty, allow_eos, suppress, eos_id, space[0], space[1], V,
                       TALKER=talker is not None, BLOCK=block, CHUNK=min(block, THREADS_PER_WARP * warps),
                       DIGIT_BITS=digit_bits or DIGIT_BITS, num_warps=warps, **launch_options(logits.device))
    return out


def fused_sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, counter: Tensor,
                 talker: tuple[Tensor, Tensor, Tensor, Tensor, int] | None = None) -> Tensor:
    """One token per row. logits [B, V] (fp32, bf16 or fp16; rows may be strided, columns contiguous);
    temperature, top_p [B] float32; top_k, seed, counter [B] int64 (counter may be a strided column view);
    talker: (seen [B, V] bool, penalty [B] float32, allow_eos [B] bool, suppress [V] bool, eos_id) to apply
    process_talker_logits first. -> [B] int64. Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1."""
    check_inputs(logits, temperature, top_k, top_p, seed, counter, talker)
    return launch(logits, temperature, top_k, top_p, seed, counter, talker,
                  scratch(logits.shape[0], logits.shape[1], logits.device))
