"""A plain eager generation loop over a batch of requests, yielding frames as they are made.

This is the reference path (synthesize CLI, parity tests). The serving engine (engine/) drives the same model
pieces through its scheduler and runner instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.model.prompt import NO_CODEC, Prompt, text_track_id
from engine.model.qwen3_tts import Qwen3TTS
from engine.model.sampling import SamplerRows
from engine.model.sampling_params import SamplingParams


@dataclass
class GenerationRequest:
    prompt: Prompt
    text_ids: list[int]  # the whole text (this loop does not stream text in)
    layout: str  # "dual" or "whole"
    sampling: SamplingParams


@dataclass
class Frame:
    request: int  # index into the request list
    index: int  # frame number within the request
    codes: Tensor  # [16] int64


@dataclass
class Finished:
    request: int
    frames: int
    reason: str  # "completed" (EOS) or "max_frames"


def sampler_rows(params: list[SamplingParams], device, talker: bool) -> SamplerRows:
    def col(values, dtype):
        return torch.tensor(values, device=device, dtype=dtype)

    if talker:
        return SamplerRows(col([p.temperature for p in params], torch.float32),
                           col([p.top_k for p in params], torch.int64),
                           col([p.top_p for p in params], torch.float32), col([p.seed for p in params], torch.int64))
    return SamplerRows(col([p.sub_temperature for p in params], torch.float32),
                       col([p.sub_top_k for p in params], torch.int64),
                       col([p.sub_top_p for p in params], torch.float32), col([p.seed for p in params], torch.int64))


@torch.inference_mode()
def generate(model: Qwen3TTS, requests: list[GenerationRequest]) -> Iterator[Frame | Finished]:
    """Yield each request's frames in order, then its Finished marker."""
    cfg = model.cfg
    device, dtype = model.talker.codec_head.weight.device, model.talker.codec_head.weight.dtype
    B = len(requests)
    lengths = torch.tensor([len(r.prompt) for r in requests], device=device)
    L = int(lengths.max())
    text = torch.full((B, L), cfg.tts_pad_id, dtype=torch.int64)
    codec = torch.full((B, L), NO_CODEC, dtype=torch.int64)
    for i, r in enumerate(requests):
        text[i, : len(r.prompt)] = torch.tensor(r.prompt.text_track)
        codec[i, : len(r.prompt)] = torch.tensor(r.prompt.codec_track)
    max_frames = max(r.sampling.max_frames for r in requests)
    cache = model.talker.new_cache(B, L + max_frames + 1, device, dtype)
    params = [r.sampling for r in requests]
    talker_rows, cp_rows = sampler_rows(params, device, True), sampler_rows(params, device, False)
    penalty = torch.tensor([p.repetition_penalty for p in params], device=device)
    min_frames = torch.tensor([p.min_frames for p in params], device=device)
    seen = torch.zeros(B, cfg.talker.stack.vocab_size, dtype=torch.bool, device=device)

    slots = torch.arange(B, device=device)
    x = model.embed_prompt(text.to(device), codec.to(device))
    positions = torch.arange(L, device=device).expand(B, L)
    hidden, logits = model.talker(x, slots, positions, cache, L, last=lengths - 1, valid_len=lengths)
    frame = torch.zeros(B, dtype=torch.int64, device=device)
    code0 = model.choose_code0(logits, talker_rows, penalty, seen, frame >= min_frames, frame)
    position = lengths.clone()
    active = list(range(B))
    while active:
        idx = torch.tensor(active, device=device)
        still = []
        for row, c0 in zip(active, code0[idx].tolist(), strict=True):
            if c0 == model.eos_id:
                yield Finished(row, int(frame[row]), "completed")
            else:
                still.append(row)
        active = still
        if not active:
            break
        idx = torch.tensor(active, device=device)
        rest, _ = model.codes_1_to_15(hidden[idx], code0[idx], _take(cp_rows, idx), frame[idx])
        codes = torch.cat([code0[idx, None], rest], dim=1)  # [b, 16]
        still = []
        for j, row in enumerate(active):
            yield Frame(row, int(frame[row]), codes[j].cpu())
            if int(frame[row]) + 1 >= requests[row].sampling.max_frames:
                yield Finished(row, int(frame[row]) + 1, "max_frames")
            else:
                still.append(j)
        keep = torch.tensor(still, device=device, dtype=torch.int64)
        active = [active[j] for j in still]
        if not active:
            break
        idx, rest = idx[keep], rest[keep]
        seen[idx, code0[idx]] = True
        track = [text_track_id(cfg, requests[r].text_ids, int(frame[r]), requests[r].layout, True) for r in active]
        x = model.next_input(code0[idx], rest, torch.tensor(track, device=device))
        h, logits = model.talker(x, idx, position[idx, None], cache, int(position[idx].max()) + 1,
                                 last=torch.zeros_like(idx))
        frame[idx] += 1
        position[idx] += 1
        hidden[idx] = h
        code0[idx] = model.choose_code0(logits, _take(talker_rows, idx), penalty[idx], seen[idx],
                                        frame[idx] >= min_frames[idx], frame[idx])


def _take(rows: SamplerRows, idx: Tensor) -> SamplerRows:
    return SamplerRows(rows.temperature[idx], rows.top_k[idx], rows.top_p[idx], rows.seed[idx])
