"""The PyTorch reference of RoPE and grouped-query attention: the model's own path where the Triton kernels do not
run (engine/model/layers.py), and what those kernels compute the same way (engine/kernels/attention.py).

Both import it; it imports neither, so the kernels never import the layers that dispatch to them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """NeoX RoPE, x * cos + rotate_half(x) * sin, bit for bit: rotate_half(x) * sin = roll(x) * signed_sin.
    x [B, H, T, D]; cos, sin_signed [B, T, D]."""
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed[:, None]


def attention(q: Tensor, k: Tensor, v: Tensor, blocked: Tensor) -> Tensor:
    """Grouped-query attention with an fp32 softmax. q [B, H, T, D]; k, v [B, Hkv, S, D]; blocked [B, 1, T, S]
    (True: no attention).
    Query head h reads key/value head h // (H / Hkv); the G query heads of one kv head go through one matmul as
    G*T rows, so keys and values are never copied G times."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    grouped = q.reshape(B, Hkv, (H // Hkv) * T, D)  # [B, Hkv, G*T, D]
    scores = torch.matmul(grouped, k.transpose(2, 3)).view(B, H, T, S) * D**-0.5  # [B, H, T, S]
    scores = scores.masked_fill(blocked, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs.view(B, Hkv, (H // Hkv) * T, S), v).view(B, H, T, D)
