"""Per-request sampling and length settings, host side. Plain Python (the scheduler imports it; no torch)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any


class SamplingError(ValueError):
    """An invalid sampling setting; the message names the field and the allowed range."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and length settings (host side). Defaults are generation_config.json's."""

    temperature: float = 0.9  # Talker; 0 = greedy for the Talker and the Code Predictor
    top_k: int = 50  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.05  # over earlier code-0 tokens of the segment
    sub_temperature: float = 0.9  # Code Predictor
    sub_top_k: int = 50
    sub_top_p: float = 1.0
    seed: int = 0
    min_frames: int = 2  # EOS is masked for the first min_frames code-0 samples (official min_new_tokens)
    max_frames: int = 2048  # complete frames a segment may return (official max_new_tokens - 1)

    @classmethod
    def from_generation_config(cls, gen: dict[str, Any]) -> SamplingParams:
        """The checkpoint's generation_config.json defaults (do_sample false there means greedy)."""
        mapping = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                   "repetition_penalty": "repetition_penalty", "subtalker_temperature": "sub_temperature",
                   "subtalker_top_k": "sub_top_k", "subtalker_top_p": "sub_top_p"}
        values = {ours: gen[theirs] for theirs, ours in mapping.items() if gen.get(theirs) is not None}
        if gen.get("do_sample", True) is False:
            values["temperature"] = 0.0
        if gen.get("subtalker_dosample", True) is False or values.get("temperature") == 0.0:
            values["sub_temperature"] = 0.0
        return replace(cls(), **values)

    def with_overrides(self, **kw: Any) -> SamplingParams:
        known = {f.name for f in fields(self)}
        unknown = set(kw) - known
        if unknown:
            raise SamplingError(f"unknown sampling field(s) {sorted(unknown)}; known: {sorted(known)}")
        p = replace(self, **{k: v for k, v in kw.items() if v is not None})
        if p.temperature == 0.0:
            p = replace(p, sub_temperature=0.0)
        p.validate()
        return p

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        checks = [
            ("temperature", 0.0 <= self.temperature <= 10.0, "0 (greedy) .. 10"),
            ("top_k", 0 <= self.top_k <= 100000, "0 (off) .. vocabulary size"),
            ("top_p", 0.0 < self.top_p <= 1.0, "(0, 1]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "(0, 10]"),
            ("subtalker.temperature", 0.0 <= self.sub_temperature <= 10.0, "0 (greedy) .. 10"),
            ("subtalker.top_k", 0 <= self.sub_top_k <= 100000, "0 (off) .. vocabulary size"),
            ("subtalker.top_p", 0.0 < self.sub_top_p <= 1.0, "(0, 1]"),
            ("seed", 0 <= self.seed < 2**63, "0 .. 2**63-1"),
            ("min_frames", 0 <= self.min_frames, ">= 0"),
            ("max_frames", 1 <= self.max_frames, ">= 1"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise SamplingError(f"{name} = {getattr(self, name.split('.')[-1], '?')!r} is out of range; "
                                    f"allowed: {allowed}")
        if self.min_frames > self.max_frames:
            raise SamplingError(f"min_frames {self.min_frames} > max_frames {self.max_frames}")
