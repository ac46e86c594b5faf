"""Run the official package and ours side by side on the same weights (test helper, not a test module)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import qwen_oracle
import torch

from engine.model.generate import Frame, GenerationRequest, generate
from engine.model.prompt import build_prompt, instruction_ids, resolve_voice, text_track_id
from engine.model.sampling import SamplerRows
from engine.model.sampling_params import SamplingParams

GREEDY_OFFICIAL = dict(do_sample=False, subtalker_dosample=False, top_k=None, top_p=None, temperature=None,
                       subtalker_top_k=None, subtalker_top_p=None, subtalker_temperature=None)
IM_START, IM_END, ASSISTANT, USER, NEWLINE = 151644, 151645, 77091, 872, 198


def official_model(checkpoint_dir):
    """The official Qwen3TTSForConditionalGeneration built from our config.json, with our weights loaded strictly."""
    from safetensors.torch import load_file

    M = qwen_oracle.modeling()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig

    cfg = Qwen3TTSConfig(**json.loads((checkpoint_dir / "config.json").read_text()))
    for c in (cfg, cfg.talker_config, cfg.talker_config.code_predictor_config):
        c._attn_implementation = "eager"
    model = M.Qwen3TTSForConditionalGeneration(cfg).eval()
    state = {}
    index = checkpoint_dir / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else {"model.safetensors"}
    for f in files:
        state.update(load_file(str(checkpoint_dir / f)))
    model.load_state_dict(state, strict=True)
    return model


@dataclass
class Case:
    layout: str  # "dual" or "whole"
    speaker: str
    language: str
    instruction: bool


@dataclass
class OfficialRun:
    codes: torch.Tensor  # [frames, 16]
    talker_logits: torch.Tensor  # [frames + 1, 3072]: prefill, then one per decode step
    cp_logits: torch.Tensor  # [frames, 15, 2048]


def official_greedy(model, case: Case, text: list[int], instr: list[int], frames: int) -> OfficialRun:
    talker_logits, cp_logits = [], []
    hooks = [
        model.talker.register_forward_hook(lambda m, a, out: talker_logits.append(out.logits[0, -1].float().clone())),
        model.talker.code_predictor.register_forward_hook(
            lambda m, a, out: cp_logits.append(out.logits[0, -1].float().clone())),
    ]
    try:
        kw = dict(input_ids=[torch.tensor([[IM_START, ASSISTANT, NEWLINE, *text, IM_END, NEWLINE, IM_START, ASSISTANT,
                                            NEWLINE]])],
                  languages=[case.language], speakers=[case.speaker], non_streaming_mode=case.layout == "whole",
                  max_new_tokens=frames + 1, repetition_penalty=1.05, **GREEDY_OFFICIAL)
        if case.instruction:
            kw["instruct_ids"] = [torch.tensor([[IM_START, USER, NEWLINE, *instr, IM_END, NEWLINE]])]
        with torch.no_grad():
            codes, _ = model.generate(**kw)
    finally:
        for h in hooks:
            h.remove()
    n = codes[0].shape[0]
    return OfficialRun(codes[0], torch.stack(talker_logits[: n + 1]), torch.stack(cp_logits[: 15 * n]).view(n, 15, -1))


def our_prompt(loaded, case: Case, text: list[int], instr: list[int]):
    cfg = loaded.config
    voice = resolve_voice(cfg, case.speaker, case.language)
    ins = instruction_ids(cfg, [USER, NEWLINE, *instr]) if case.instruction else None
    return build_prompt(cfg, voice, text, case.layout, ins)


def our_greedy(loaded, case: Case, text: list[int], instr: list[int], frames: int) -> torch.Tensor:
    sp = SamplingParams(temperature=0.0, sub_temperature=0.0, max_frames=frames)
    req = GenerationRequest(our_prompt(loaded, case, text, instr), text, case.layout, sp)
    out = [e.codes for e in generate(loaded.tts, [req]) if isinstance(e, Frame)]
    return torch.stack(out)


@torch.no_grad()
def our_teacher_forced(loaded, case: Case, text: list[int], instr: list[int], codes: torch.Tensor):
    """Talker logits [frames + 1, V] and Code Predictor logits [frames, 15, V] when fed the given codes."""
    model, cfg = loaded.tts, loaded.config
    prompt = our_prompt(loaded, case, text, instr)
    L, n = len(prompt), codes.shape[0]
    cache = model.talker.new_cache(1, L + n + 1, loaded.device, loaded.dtype)
    slots = torch.zeros(1, dtype=torch.int64)
    x = model.embed_prompt(torch.tensor([prompt.text_track]), torch.tensor([prompt.codec_track]))
    hidden, logits = model.talker(x, slots, torch.arange(L)[None], cache, L, last=torch.tensor([L - 1]))
    rows = SamplerRows(torch.zeros(1), torch.zeros(1, dtype=torch.int64), torch.ones(1),
                       torch.zeros(1, dtype=torch.int64))
    talker_logits, cp_logits = [logits[0]], []
    for s in range(n):
        _, cpl = model.codes_1_to_15(hidden, codes[s : s + 1, 0], rows, torch.tensor([s]),
                                     forced=codes[s : s + 1, 1:], keep_logits=True)
        cp_logits.append(cpl[0])
        track = text_track_id(cfg, text, s, case.layout, True)
        x = model.next_input(codes[s : s + 1, 0], codes[s : s + 1, 1:], torch.tensor([track]))
        hidden, logits = model.talker(x, slots, torch.tensor([[L + s]]), cache, L + s + 1,
                                      last=torch.zeros(1, dtype=torch.int64))
        talker_logits.append(logits[0])
    return torch.stack(talker_logits), torch.stack(cp_logits)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())
