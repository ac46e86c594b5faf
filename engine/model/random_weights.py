"""Non-degenerate random weights for the language model, for tests and GPU work without real checkpoints.

HF-style N(0, 0.02) init leaves the code-0 and code-1..15 logits nearly flat, so a greedy choice would hinge on
rounding; the output heads are scaled up so choices have clear margins (as the parity oracle does). Norm weights
are drawn around 1 so a forgotten weight multiply shows up in parity tests.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.qwen3_tts import Qwen3TTS

HEAD_GAIN = 8.0


@torch.no_grad()
def randomize_tts_(model: Qwen3TTS, seed: int, head_gain: float = HEAD_GAIN) -> None:
    device = model.talker.codec_head.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(torch.rand(p.shape, generator=gen, device=device, dtype=torch.float32) * 0.4 + 0.8)
        elif name.endswith(".bias"):
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * 0.01)
        else:
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * 0.02)
    heads: list[nn.Linear] = [model.talker.codec_head, *model.talker.code_predictor.lm_head]
    for head in heads:
        head.weight.mul_(head_gain)
