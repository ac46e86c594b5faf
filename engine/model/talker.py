"""The Talker: a 28-layer Qwen3-style decoder that predicts code 0 of every frame.

Its input at a decode step is the sum of the 16 code embeddings of the frame just finished plus one text-track
embedding; its prompt is built by engine.model.prompt. Module names mirror the checkpoint's tensor names
(talker.model.layers.N..., talker.codec_head, talker.text_projection.linear_fc1, talker.code_predictor...).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine import kernels
from engine.model.code_predictor import CodePredictor
from engine.model.config import TalkerConfig
from engine.model.layers import AttentionBatch, DecoderStack, FusedRows, KVCache, dense, rope_cos_sin, signed_sin


class TalkerStack(DecoderStack):
    def __init__(self, cfg: TalkerConfig):
        super().__init__(cfg.stack)
        self.codec_embedding = nn.Embedding(cfg.stack.vocab_size, cfg.stack.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class TextProjection(nn.Module):
    def __init__(self, text_hidden: int, hidden: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden, hidden, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class Talker(nn.Module):
    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        self.cfg = cfg
        self.model = TalkerStack(cfg)
        self.text_projection = TextProjection(cfg.text_hidden_size, cfg.stack.hidden_size)
        self.codec_head = nn.Linear(cfg.stack.hidden_size, cfg.stack.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg)
        self.frame_tables: FusedRows | None = None  # prepare_inference()
        self._compiled: Callable | None = None  # the compiled decode step (_compiled_step), made on first use

    def new_cache(self, slots: int, max_len: int, device, dtype) -> KVCache:
        return KVCache.allocate(self.cfg.stack, slots, max_len, device, dtype)

    def embed_text(self, ids: Tensor) -> Tensor:
        """Text-track embeddings: ids [...] -> [..., hidden]."""
        return self.text_projection(self.model.text_embedding(ids))

    def embed_codec(self, ids: Tensor) -> Tensor:
        return self.model.codec_embedding(ids)

    def prepare_inference(self) -> None:
        """The 16 input tables a frame embedding reads (code 0's, then the Code Predictor's 15) as one stacked
        table, so a frame is one lookup and one sum; the tables become views of it (their names and files stay)."""
        tables = [self.model.codec_embedding, *self.code_predictor.model.codec_embedding]
        self.frame_tables = FusedRows(*tables)
        starts = [0]
        for table in tables[:-1]:
            starts.append(starts[-1] + table.num_embeddings)
        self.frame_offsets = torch.tensor(starts, device=self.frame_tables.weight.device)  # [16]

    def frame_embedding(self, code0: Tensor, rest: Tensor) -> Tensor:
        """Sum of a frame's 16 code embeddings: code0 [B], rest [B, 15] -> [B, hidden]."""
        if self.frame_tables is not None:
            ids = torch.cat((code0[:, None], rest), dim=1)  # [B, 16]
            table = self.frame_tables.current()
            if self.frame_offsets.device != table.device:  # the model moved after preparation
                self.frame_offsets = self.frame_offsets.to(table.device)
            return F.embedding(ids + self.frame_offsets, table).sum(dim=1)  # rows of the stacked table
        parts = [self.embed_codec(code0)] + self.code_predictor.code_embeddings(rest)
        return torch.stack(parts, dim=1).sum(dim=1)

    def forward(self, x: Tensor, slots: Tensor, positions: Tensor, cache: KVCache, kv_len: int,
                last: Tensor, valid_len: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Run new positions of a batch of cache rows.

        x [B, T, hidden]; slots [B]; positions [B, T]; kv_len: cache columns attended (> every position);
        last [B] int64: which of the T positions gives each row's output; valid_len [B]: columns a row wrote.
        Returns the final-norm hidden state [B, hidden] and code-0 logits [B, vocab] float32 at `last`.
        """
        with kernels.model_part("talker", x.shape[0] * x.shape[1]):  # its launches (PDL per part and rows: pdl.py)
            if x.shape[1] == 1 and valid_len is None and (step := self._compiled_step(x.device)) is not None:
                cos, sin = rope_cos_sin(positions, self.cfg.stack.head_dim, self.cfg.stack.rope_theta, x.dtype)
                return step(self.model, x, slots, positions, cos, signed_sin(sin), cache.k, cache.v,
                            self.codec_head.weight)
            batch = AttentionBatch.build(self.cfg.stack, slots, positions, kv_len, x.dtype, valid_len)
            hidden = self.model.run(x, batch, cache)  # [B, T, hidden]
            if x.shape[1] == 1:  # a decode step: `last` can only be 0, and a view needs no gather kernel
                hidden = hidden[:, 0]
            else:
                hidden = hidden[torch.arange(x.shape[0], device=x.device), last]  # [B, hidden]
            return hidden, dense(hidden, self.codec_head.weight).float()

    def _compiled_step(self, device: torch.device) -> Callable | None:
        """decode_step through torch.compile when VOICELANE_COMPILE names the Talker (engine.kernels.compiled),
        else None. Its attention is the Triton kernels' op, which reads each row's cache in place: no mask and no
        attention length among its inputs, so one compile serves every length bucket of a batch bucket."""
        from engine.kernels.compiled import compile_parts, compiled

        if "talker" not in compile_parts():
            return None
        if not kernels.use_triton(device):
            raise kernels.KernelsUnavailable("VOICELANE_COMPILE=talker runs the Triton attention kernels inside the "
                                             f"compiled step, and they do not run on {device}")
        if self._compiled is None:
            self._compiled = compiled("talker", decode_step)
        return self._compiled


def decode_step(stack: DecoderStack, x: Tensor, slots: Tensor, positions: Tensor, cos: Tensor, sin_signed: Tensor,
                k_cache: Tensor, v_cache: Tensor, head: Tensor) -> tuple[Tensor, Tensor]:
    """One new position of every row, as Talker.forward computes it: x [B, 1, hidden]; slots [B]; positions [B, 1];
    cos, sin_signed [B, 1, head_dim]; the whole cache -> (final-norm hidden [B, hidden], logits [B, vocab] float32).
    Attention must be the in-place Triton op (kernels.compiled_attention): the batch carries no mask."""
    batch = AttentionBatch(slots, positions, None, cos, sin_signed)
    hidden = stack.run(x, batch, KVCache(k_cache, v_cache))[:, 0]
    return hidden, dense(hidden, head).float()
