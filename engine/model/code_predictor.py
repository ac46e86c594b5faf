"""The Code Predictor ("sub-talker"): codes 1..15 of a frame from the Talker's hidden state and code 0.

One frame is 15 dependent forwards over at most 16 positions with a KV cache that lives for that frame only:
forward 1 sees [P(h), P(E0(c0))] and predicts c1 with lm_head[0]; forward g (2..15) sees P(Ecp[g-2](c_{g-1}))
at position g and predicts c_g with lm_head[g-1]. P is small_to_mtp_projection (identity for 0.6B).

prepare_inference() (called once after the weights are loaded) stores P(Ecp[g]) for every table, so each step
reads one row instead of an embedding lookup plus a Linear.

On the Triton path with VOICELANE_CP_FORWARD=phased or persistent, each forward (the stack and the group's head) is
engine.kernels.cp_forward: 26 launches a forward, or one. With VOICELANE_COMPILE=code_predictor it is
cp_forward_reference through torch.compile (engine.kernels.compiled).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine import kernels
from engine.model.config import TalkerConfig
from engine.model.layers import AttentionBatch, DecoderStack, KVCache, dense

log = logging.getLogger("voicelane.code_predictor")


class CodePredictorStack(DecoderStack):
    def __init__(self, talker: TalkerConfig):
        super().__init__(talker.code_predictor)
        groups = talker.num_code_groups - 1
        # Input tables live in the Talker's width: the Talker also sums them into its next input.
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(talker.code_predictor.vocab_size, talker.stack.hidden_size) for _ in range(groups))


class CodePredictor(nn.Module):
    def __init__(self, talker: TalkerConfig):
        super().__init__()
        cfg = talker.code_predictor
        self.cfg = cfg
        self.groups = talker.num_code_groups - 1
        self.model = CodePredictorStack(talker)
        self.lm_head = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(self.groups))
        if talker.stack.hidden_size != cfg.hidden_size:
            self.small_to_mtp_projection = nn.Linear(talker.stack.hidden_size, cfg.hidden_size, bias=True)
        else:
            self.small_to_mtp_projection = nn.Identity()
        # [groups - 1, V, H_cp]: P(Ecp[g]) for the inputs of forwards 2..15 (not in the checkpoint: derived)
        self.register_buffer("projected_codec_embedding", None, persistent=False)
        self._unprepared_logged = False
        self._compiled: Callable | None = None  # the compiled forward (_compiled_forward), made on first use

    @torch.no_grad()
    def prepare_inference(self) -> None:
        """Derive the projected input tables from the loaded weights (again after any weight change). Without a
        projection (0.6B) the tables are the embeddings themselves: nothing to store."""
        if isinstance(self.small_to_mtp_projection, nn.Identity):
            return
        tables = [self.model.codec_embedding[g].weight for g in range(self.groups - 1)]
        self.projected_codec_embedding = torch.stack([self.small_to_mtp_projection(t) for t in tables])

    def _next_input(self, group: int, code: Tensor) -> Tensor:
        """Input of forward group + 1 from code c_group [B] -> [B, 1, H_cp]."""
        if self.projected_codec_embedding is not None:
            return F.embedding(code, self.projected_codec_embedding[group - 1])[:, None]
        if isinstance(self.small_to_mtp_projection, nn.Identity):
            return self.model.codec_embedding[group - 1](code)[:, None]
        if not self._unprepared_logged:
            log.warning("CodePredictor.prepare_inference() was not called: projecting every code's embedding")
            self._unprepared_logged = True
        return self.small_to_mtp_projection(self.model.codec_embedding[group - 1](code))[:, None]

    @property
    def positions(self) -> int:
        return self.groups + 1

    def new_cache(self, batch: int, device, dtype) -> KVCache:
        return KVCache.allocate(self.cfg, batch, self.positions, device, dtype)

    def run_frame(self, hidden: Tensor, code0_embedding: Tensor, choose: Callable[[int, Tensor], Tensor],
                  cache: KVCache | None = None, forced: Tensor | None = None,
                  keep_logits: bool = False) -> tuple[Tensor, Tensor | None]:
        """Codes 1..15 for a batch of frames.

        hidden [B, H_talker]: Talker output (after its final norm) that produced code 0;
        code0_embedding [B, H_talker]: E0(code 0);
        choose(group, logits [B, V] in the model's dtype) -> codes [B] int64, group = 1..15;
        forced [B, 15] (teacher forcing, tests): feed these codes instead of the chosen ones.
        Returns codes [B, 15] int64 and, with keep_logits, logits [B, 15, V] float32.
        """
        with kernels.model_part("code_predictor", hidden.shape[0]):  # its launches (PDL per part and rows: pdl.py)
            B = hidden.shape[0]
            device, dtype = hidden.device, hidden.dtype
            cache = cache if cache is not None else self.new_cache(B, device, dtype)
            rows = torch.arange(B, device=device)
            # Positions are the same every frame: build RoPE tables and masks for all 16 once, slice per forward.
            every = AttentionBatch.build(self.cfg, rows, torch.arange(self.positions, device=device).expand(B, -1),
                                         self.positions, dtype)
            x = self.small_to_mtp_projection(torch.stack((hidden, code0_embedding), dim=1))  # [B, 2, H_cp]
            forward = self._forward_kernel(device, B) or self._compiled_forward()
            codes, logits_seen = [], []
            for group in range(1, self.groups + 1):
                span = slice(0, 2) if group == 1 else slice(group, group + 1)
                batch = AttentionBatch(rows, every.positions[:, span], every.blocked[:, :, span], every.cos[:, span],
                                       every.sin_signed[:, span])
                if forward is not None:
                    logits = forward(group, x.contiguous(), batch, cache)
                else:
                    h = self.model.run(x, batch, cache)[:, -1]  # [B, H_cp]
                    logits = dense(h, self.lm_head[group - 1].weight)  # [B, V] model dtype: the sampler reads it
                code = choose(group, logits)
                if forced is not None:
                    code = forced[:, group - 1]
                codes.append(code)
                if keep_logits:
                    logits_seen.append(logits.float())
                if group < self.groups:
                    x = self._next_input(group, code)
            return torch.stack(codes, dim=1), (torch.stack(logits_seen, dim=1) if keep_logits else None)

    def _forward_kernel(self, device, rows: int) -> Callable[[int, Tensor, AttentionBatch, KVCache], Tensor] | None:
        """The one-kernel forward of engine.kernels.cp_forward when it is switched on and takes `rows` rows (the
        first forward's two tokens a row within the mode's max_rows; a larger batch runs the layer-by-layer kernels,
        which is logged once per batch size and in /ready's cp_forward details), else None. Its persistent and
        streamed launches share one set of barrier counters a frame (a single memset)."""
        if not kernels.use_triton(device):
            return None
        from engine.kernels.cp_forward import MAX_ROWS, barrier_counters, cp_forward, cp_forward_mode, refuse_rows
        from engine.kernels.cp_stream import STREAM_ROWS, stream_forward

        mode = cp_forward_mode()
        if mode == "off" or refuse_rows(2 * rows, STREAM_ROWS if mode == "streamed" else MAX_ROWS, mode):
            return None
        barriers = mode in ("persistent", "streamed")
        counters = barrier_counters(self.groups, self.cfg.num_layers, device) if barriers else None

        def forward(group: int, x: Tensor, batch: AttentionBatch, cache: KVCache) -> Tensor:
            args = (self.model, x, batch.cos, batch.sin_signed, cache.k, cache.v, batch.slots, batch.positions,
                    self.model.norm.weight, self.lm_head[group - 1].weight)
            if mode == "streamed":
                return stream_forward(*args, counters[group - 1])
            return cp_forward(*args, mode, counters[group - 1] if counters is not None else None)
        return forward

    def _compiled_forward(self) -> Callable[[int, Tensor, AttentionBatch, KVCache], Tensor] | None:
        """The forward (stack and head) through torch.compile when VOICELANE_COMPILE names the Code Predictor
        (engine.kernels.compiled), else None. One compiled function for every group: the head is an argument, and
        the group's positions, RoPE rows and mask are views of tensors built once a frame."""
        from engine.kernels.compiled import compile_parts, compiled

        if "code_predictor" not in compile_parts():
            return None
        if self._compiled is None:
            self._compiled = compiled("code_predictor", cp_forward_reference)

        def forward(group: int, x: Tensor, batch: AttentionBatch, cache: KVCache) -> Tensor:
            return self._compiled(self.model, x, batch.cos, batch.sin_signed, cache.k, cache.v, batch.slots,
                                  batch.positions, self.model.norm.weight, self.lm_head[group - 1].weight)
        return forward

    def code_embeddings(self, codes: Tensor) -> list[Tensor]:
        """The 15 input-table rows of codes [B, 15], each [B, H_talker]."""
        return [self.model.codec_embedding[g](codes[:, g]) for g in range(self.groups)]


def cp_forward_reference(stack: nn.Module, x: Tensor, cos: Tensor, sin_signed: Tensor, k_cache: Tensor,
                         v_cache: Tensor, slots: Tensor, positions: Tensor, final_norm: Tensor, head: Tensor) -> Tensor:
    """engine.kernels.cp_forward's reference: the model's own path with the kernel's arguments (final_norm is the
    stack's own norm), DecoderStack.run, then the head on each row's last token -> logits [B, V]."""
    C = k_cache.shape[3]
    cols = torch.arange(C, device=x.device)
    blocked = ~(cols[None, None, :] <= positions[:, :, None])[:, None]
    batch = AttentionBatch(slots, positions, blocked, cos, sin_signed)
    h = stack.run(x, batch, KVCache(k_cache, v_cache))[:, -1]
    return dense(h, head)
