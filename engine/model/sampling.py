"""Token choice on the accelerator: logits processors, top-k / top-p, and seeded sampling without host syncs.

Randomness is counter-based: the uniform draw for (request seed, draw counter, vocabulary index) is a pure
hash, so a request samples the same tokens whatever batch it runs in and whatever ran before it. Sampling is
Gumbel-max over the filtered, temperature-scaled logits (equivalent to drawing from their softmax).
Temperature 0 means greedy (argmax after the processors), as in docs/protocol.md 1.6.

`sample` and `FrameDraws` are what the model calls: on CUDA they run the fused Triton sampler
(engine.kernels.sampler), elsewhere `process_talker_logits` + `choose` below, which stay the reference the kernel
is tested against.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

log = logging.getLogger("voicelane.sampling")

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**31, so a 32-bit value times it stays inside int64


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mixer on int64 tensors holding values in [0, 2**32)."""
    x = (x ^ (x >> 16)) * _MIX & _MASK32
    x = (x ^ (x >> 16)) * _MIX & _MASK32
    return x ^ (x >> 16)


def _hash_bits(seed: Tensor, counter: Tensor, vocab: int) -> Tensor:
    """32 random bits [B, vocab] (int64) that depend only on (seed[b], counter[b], column)."""
    h = _hash32(seed & _MASK32)
    h = _hash32(h ^ ((seed >> 32) & _MASK32))
    h = _hash32(h ^ (counter & _MASK32))  # [B]
    cols = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    return _hash32((h[:, None] + cols[None, :] * 0x9E3779B1) & _MASK32)


def uniform_noise(seed: Tensor, counter: Tensor, vocab: int) -> Tensor:
    """Uniform draws in the open interval (0, 1), float64 [B, vocab] (float32 would round the top ones to 1)."""
    return (_hash_bits(seed, counter, vocab).double() + 0.5).div_(2.0**32)


def gumbel_noise(seed: Tensor, counter: Tensor, vocab: int) -> Tensor:
    """Standard Gumbel draws, float32, always finite (within about [-3.2, 22.2]): seed [B] with counter [B] ->
    [B, vocab], or with counter [B, G] -> [B, G, vocab] (G draws per row in one pass: the Code Predictor's 15).

    Computed in float64: a float32 uniform rounds to exactly 1.0 for about one draw in 3e7, whose Gumbel value
    is +inf; added to a masked (-inf) logit that gives NaN, and argmax then picks the masked token (a suppressed
    code-0 id the codec cannot decode)."""
    seeds = seed.reshape(seed.shape + (1,) * (counter.dim() - 1)).expand_as(counter)
    u = uniform_noise(seeds.reshape(-1), counter.reshape(-1), vocab)
    return (-torch.log(-torch.log(u))).float().view(*counter.shape, vocab)


@dataclass
class SamplerRows:
    """Per-row sampling settings of one batch, on the device."""

    temperature: Tensor  # [B] float32, 0 = greedy
    top_k: Tensor  # [B] int64, 0 = off
    top_p: Tensor  # [B] float32
    seed: Tensor  # [B] int64


@dataclass
class RowConstants:
    """What choose() derives from the rows alone; the Code Predictor's 15 draws per frame share one."""

    temperature: Tensor  # [B, 1] float32, 1 for greedy rows (their scores are unused)
    kth_index: Tensor  # [B, 1] int64, index of the k-th best score in descending order
    keep_all: Tensor  # [B, 1] bool, top_p >= 1 (no nucleus cut)
    sampled: Tensor  # [B] bool, temperature > 0


def row_constants(rows: SamplerRows, vocab: int) -> RowConstants:
    sampled = rows.temperature > 0
    temperature = torch.where(sampled, rows.temperature, torch.ones_like(rows.temperature))
    k = torch.where(rows.top_k > 0, rows.top_k, torch.full_like(rows.top_k, vocab)).clamp(1, vocab)
    return RowConstants(temperature[:, None], (k - 1)[:, None], (rows.top_p >= 1.0)[:, None], sampled)


def choose(logits: Tensor, rows: SamplerRows, counter: Tensor, gumbel: Tensor | None = None,
           constants: RowConstants | None = None) -> Tensor:
    """Pick one token per row. logits [B, V] float32 (already processed); counter [B] int64 -> [B] int64.
    gumbel [B, V]: the draws for this counter, when made ahead (gumbel_noise with several counters at once);
    constants: row_constants(rows, V), when made ahead."""
    B, V = logits.shape
    c = constants if constants is not None else row_constants(rows, V)
    greedy = logits.argmax(dim=-1)
    scores = logits / c.temperature
    sorted_desc, _ = scores.sort(dim=-1, descending=True)  # [B, V]
    kth = sorted_desc.gather(1, c.kth_index)  # [B, 1]
    scores = scores.masked_fill(scores < kth, float("-inf"))
    # top-p: keep a token while the probability mass ranked strictly above it is below top_p.
    sorted_desc = sorted_desc.masked_fill(sorted_desc < kth, float("-inf"))
    probs = torch.softmax(sorted_desc, dim=-1)
    mass_above = torch.cumsum(probs, dim=-1) - probs  # [B, V]
    cut = (mass_above < rows.top_p[:, None]) | c.keep_all
    last_kept = cut.sum(dim=-1, keepdim=True).clamp(min=1) - 1
    threshold = sorted_desc.gather(1, last_kept)
    scores = scores.masked_fill(scores < threshold, float("-inf"))
    if gumbel is None:
        gumbel = gumbel_noise(rows.seed, counter, V)
    sampled = (scores + gumbel).argmax(dim=-1)
    return torch.where(c.sampled, sampled, greedy)


def process_talker_logits(logits: Tensor, seen: Tensor, penalty: Tensor, allow_eos: Tensor,
                          suppress: Tensor, eos_id: int) -> Tensor:
    """The official processors in order: repetition penalty, min frames (EOS masked), code-0 suppression.

    logits [B, V] float32; seen [B, V] bool (code-0 tokens generated earlier in the segment); penalty [B];
    allow_eos [B] bool; suppress [V] bool (ids 2048.. except EOS)."""
    p = penalty[:, None]
    penalised = torch.where(logits < 0, logits * p, logits / p)
    logits = torch.where(seen, penalised, logits)
    eos_col = torch.arange(suppress.shape[0], device=suppress.device) == eos_id  # no host-to-device copy
    blocked = suppress[None, :] | (eos_col[None, :] & ~allow_eos[:, None])
    return logits.masked_fill(blocked, float("-inf"))


@dataclass
class TalkerRules:
    """process_talker_logits' inputs for one batch (see there)."""

    seen: Tensor  # [B, V] bool
    penalty: Tensor  # [B] float32
    allow_eos: Tensor  # [B] bool
    suppress: Tensor  # [V] bool
    eos_id: int

    def as_tuple(self) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
        return self.seen, self.penalty, self.allow_eos, self.suppress, self.eos_id


FUSED_ON_CUDA = True  # the GPU check script turns this off to time the reference on the same model
_fallback_logged = False


def fused_for(device: torch.device) -> bool:
    """Whether draws on `device` run the fused kernel. A CUDA device without one is logged (once) and shows in
    engine.kernels.sampler.kernels_status(), which readiness reports."""
    global _fallback_logged
    if device.type != "cuda" or not FUSED_ON_CUDA:
        return False
    from engine.kernels import sampler

    if not sampler.available() and not _fallback_logged:
        log.error("fused sampler unavailable on %s, sampling with the PyTorch reference (slow): %s", device,
                  sampler.kernels_status()["reason"])
        _fallback_logged = True
    return sampler.available()


def sample(logits: Tensor, rows: SamplerRows, counter: Tensor, talker: TalkerRules | None = None) -> Tensor:
    """One token per row from raw logits [B, V] (any float dtype), after the Talker's rules when given.
    counter [B] int64 -> [B] int64."""
    if fused_for(logits.device):
        from engine.kernels.sampler import fused_sample

        return fused_sample(logits, rows.temperature, rows.top_k, rows.top_p, rows.seed, counter,
                            talker.as_tuple() if talker is not None else None)
    logits = logits.float()
    if talker is not None:
        logits = process_talker_logits(logits, talker.seen, talker.penalty, talker.allow_eos, talker.suppress,
                                       talker.eos_id)
    return choose(logits, rows, counter)


class FrameDraws:
    """The Code Predictor's draws for one frame, one call per group: rows and counters [B, G] are fixed for the
    frame, so everything derived from them is made once here, none per draw (and nothing syncs the host)."""

    def __init__(self, rows: SamplerRows, counters: Tensor, vocab: int):
        self.rows, self.counters = rows, counters
        self.fused = fused_for(counters.device)
        if self.fused:
            from engine.kernels import sampler

            self._kernel = sampler
            self._space = sampler.scratch(counters.shape[0], vocab, counters.device)
            self._checked = False
        else:
            # All groups' noise in one pass: the same draws as one group at a time, in far fewer kernels.
            self._noise = gumbel_noise(rows.seed, counters, vocab)  # [B, G, V]
            self._constants = row_constants(rows, vocab)

    def __call__(self, group: int, logits: Tensor) -> Tensor:
        """Codes [B] int64 for group 1..G from logits [B, V] (any float dtype)."""
        r, counter = self.rows, self.counters[:, group - 1]
        if not self.fused:
            return choose(logits.float(), r, counter, self._noise[:, group - 1], self._constants)
        args = (logits, r.temperature, r.top_k, r.top_p, r.seed, counter)
        if not self._checked:  # the later groups' logits come from the same head shapes
            self._kernel.check_inputs(*args)
            self._checked = True
        return self._kernel.launch(*args, None, self._space)
