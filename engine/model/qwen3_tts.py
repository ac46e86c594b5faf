"""The whole Qwen3-TTS language model (Talker with its Code Predictor) and the per-frame helpers around it.

The codec decoder that turns codes into audio is engine.model.codec; the two are loaded side by side.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.model.config import ModelConfig
from engine.model.prompt import NO_CODEC
from engine.model.sampling import FrameDraws, SamplerRows, TalkerRules, sample
from engine.model.talker import Talker

DRAWS_PER_FRAME = 16  # one sampling counter per code of a frame: frame * 16 + group


class Qwen3TTS(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.talker = Talker(cfg.talker)
        vocab = cfg.talker.stack.vocab_size
        self.register_buffer("code0_suppressed", torch.zeros(vocab, dtype=torch.bool), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """Derived, non-persistent buffers (re-run after building on the meta device)."""
        with torch.no_grad():
            # The official package blocks the top 1024 codec ids for code 0, except EOS.
            self.code0_suppressed.zero_()
            self.code0_suppressed[-1024:] = True
            self.code0_suppressed[self.cfg.talker.codec_eos_id] = False

    @property
    def eos_id(self) -> int:
        return self.cfg.talker.codec_eos_id

    def embed_prompt(self, text_track: Tensor, codec_track: Tensor) -> Tensor:
        """Prompt embeddings: text_track, codec_track [B, L] int64 (NO_CODEC = text only) -> [B, L, hidden]."""
        x = self.talker.embed_text(text_track)
        has_codec = codec_track != NO_CODEC
        codec = self.talker.embed_codec(codec_track.clamp(min=0)) * has_codec[..., None].to(x.dtype)
        # Positions without a codec id add an exact zero, so they equal the text-only embedding bit for bit.
        return x + codec

    def next_input(self, code0: Tensor, rest: Tensor, text_ids: Tensor) -> Tensor:
        """Talker input of a decode step: frame embedding + text-track embedding. -> [B, 1, hidden]."""
        return (self.talker.frame_embedding(code0, rest) + self.talker.embed_text(text_ids))[:, None]

    def choose_code0(self, logits: Tensor, rows: SamplerRows, penalty: Tensor, seen: Tensor, allow_eos: Tensor,
                     frame: Tensor) -> Tensor:
        """Code 0 of frame `frame` [B] from raw Talker logits [B, V]."""
        rules = TalkerRules(seen, penalty, allow_eos, self.code0_suppressed, self.eos_id)
        return sample(logits, rows, frame * DRAWS_PER_FRAME, rules)

    def codes_1_to_15(self, hidden: Tensor, code0: Tensor, rows: SamplerRows, frame: Tensor,
                      **kw) -> tuple[Tensor, Tensor | None]:
        """Run the Code Predictor for one frame per row: codes [B, 15] int64 and, with keep_logits, their logits
        [B, 15, V]. kw: cache, forced, keep_logits (see CodePredictor.run_frame)."""
        groups = self.cfg.talker.num_code_groups - 1
        counters = frame[:, None] * DRAWS_PER_FRAME + torch.arange(1, groups + 1, device=frame.device)  # [B, 15]
        draws = FrameDraws(rows, counters, self.cfg.talker.code_predictor.vocab_size)
        return self.talker.code_predictor.run_frame(hidden, self.talker.embed_codec(code0), draws, **kw)
