"""What a context is opened with (docs/protocol.md 1.1, 1.4, 1.6, 3): output formats, sampling settings, voices and
languages, session defaults, and their resolution into ContextOptions - shared by the WebSocket and HTTP doors, so
the same fields mean the same thing on both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from engine import SamplingError, SamplingParams
from server.protocol import ProtocolError, get_int, get_number, get_object, get_str, type_name

# ------------------------------------------------------------------------------------------------ output formats

PCM_RATES = (24000, 16000, 8000)
OPUS_BITRATE_RANGE = (6000, 256000)
_SHORTHAND = re.compile(r"^(pcm|pcm_s16le|pcm_f32le|mulaw|ulaw|pcm_mulaw|opus)(?:_(\d+))?(?:_(\d+))?$")
_ENCODING_ALIASES = {"pcm": "pcm_s16le", "mulaw": "pcm_mulaw", "ulaw": "pcm_mulaw"}


@dataclass(frozen=True)
class OutputFormat:
    encoding: str = "pcm_s16le"  # pcm_s16le | pcm_f32le | pcm_mulaw | opus
    sample_rate: int = 24000  # 48000 for Opus (the decoder clock); the PCM rate otherwise
    channels: int = 1
    frame_ms: int = 20  # Opus only
    bitrate: int = 32000  # Opus only

    @property
    def is_opus(self) -> bool:
        return self.encoding == "opus"

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"encoding": self.encoding, "sample_rate": self.sample_rate, "channels": self.channels}
        if self.is_opus:
            d |= {"frame_ms": self.frame_ms, "bitrate": self.bitrate}
        return d


def parse_output_format(v: Any, param: str = "output_format") -> OutputFormat:
    """The object form or a shorthand string ("opus_48000_32", "pcm_24000", "pcm_16000", "mulaw_8000")."""
    if isinstance(v, str):
        m = _SHORTHAND.match(v.strip().lower())
        if not m:
            raise ProtocolError("unsupported_format", f"unknown output format {v!r}; use an object or one of "
                                "opus_48000_32, pcm_24000, pcm_16000, pcm_8000, mulaw_8000", param)
        enc = _ENCODING_ALIASES.get(m.group(1), m.group(1))
        obj: dict[str, Any] = {"encoding": enc}
        if m.group(2):
            obj["sample_rate"] = int(m.group(2))
        if m.group(3):
            if enc != "opus":
                raise ProtocolError("unsupported_format", f"unknown output format {v!r}", param)
            obj["bitrate"] = int(m.group(3)) * 1000
        v = obj
    if not isinstance(v, dict):
        raise ProtocolError("invalid_field", f"'{param}' must be an object or a string, got {type_name(v)}", param)
    enc = get_str(v, "encoding", param=f"{param}.encoding") or "pcm_s16le"
    enc = _ENCODING_ALIASES.get(enc, enc)
    rate = get_int(v, "sample_rate", param=f"{param}.sample_rate")
    channels = get_int(v, "channels", param=f"{param}.channels")
    if channels not in (None, 1):
        raise ProtocolError("unsupported_format", f"channels {channels}: only mono (1) is produced", param)
    if enc == "opus":
        if rate not in (None, 48000):
            raise ProtocolError("unsupported_format", f"Opus sample_rate {rate}: Opus streams use the 48000 Hz "
                                "decoder clock (encoded from the model's 24 kHz PCM)", param)
        frame_ms = get_int(v, "frame_ms", param=f"{param}.frame_ms")
        if frame_ms not in (None, 20):
            raise ProtocolError("unsupported_format", f"Opus frame_ms {frame_ms}: only 20 ms packets are produced",
                                param)
        bitrate = get_int(v, "bitrate", param=f"{param}.bitrate")
        if bitrate is not None and not OPUS_BITRATE_RANGE[0] <= bitrate <= OPUS_BITRATE_RANGE[1]:
            raise ProtocolError("unsupported_format", f"Opus bitrate {bitrate}; allowed "
                                f"{OPUS_BITRATE_RANGE[0]}..{OPUS_BITRATE_RANGE[1]} bit/s", param)
        return OutputFormat("opus", 48000, 1, 20, bitrate or 32000)
    if enc == "pcm_mulaw":
        if rate not in (None, 8000):
            raise ProtocolError("unsupported_format", f"pcm_mulaw sample_rate {rate}: mu-law is 8000 Hz", param)
        return OutputFormat("pcm_mulaw", 8000)
    if enc in ("pcm_s16le", "pcm_f32le"):
        rate = rate or 24000
        if rate not in PCM_RATES:
            raise ProtocolError("unsupported_format", f"PCM sample_rate {rate}; one of {PCM_RATES}", param)
        return OutputFormat(enc, rate)
    raise ProtocolError("unsupported_format", f"unknown encoding {enc!r}; one of pcm_s16le, pcm_f32le, pcm_mulaw, "
                        "opus", param)


# ------------------------------------------------------------------------------------------------ sampling

# protocol field -> SamplingParams field
SAMPLING_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                   "repetition_penalty": "repetition_penalty", "seed": "seed"}
SUBTALKER_FIELDS = {"temperature": "sub_temperature", "top_k": "sub_top_k", "top_p": "sub_top_p"}
_INT_FIELDS = {"top_k", "seed", "sub_top_k"}
_PARAM_NAMES = {v: k for k, v in SAMPLING_FIELDS.items()} | {v: f"subtalker.{k}" for k, v in SUBTALKER_FIELDS.items()}


def parse_sampling(v: Any, param: str = "sampling") -> dict[str, Any]:
    """The protocol's `sampling` object -> {SamplingParams field: value} (only the fields given; null = unset).
    Types are checked here, ranges by `validate_sampling`."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ProtocolError("invalid_field", f"'{param}' must be an object, got {type_name(v)}", param)
    out = _sampling_values(v, SAMPLING_FIELDS, param)
    return out | _sampling_values(get_object(v, "subtalker", param=f"{param}.subtalker") or {}, SUBTALKER_FIELDS,
                                  f"{param}.subtalker")


def _sampling_values(obj: dict, names: dict[str, str], param: str) -> dict[str, Any]:
    return {ours: (get_int if ours in _INT_FIELDS else get_number)(obj, name, param=f"{param}.{name}")
            for name, ours in names.items() if name in obj}


def validate_sampling(base: SamplingParams, overrides: dict[str, Any], param: str = "sampling") -> SamplingParams:
    """base + overrides (None values keep base), range-checked; ProtocolError(invalid_field) names the field."""
    try:
        return base.with_overrides(**{k: v for k, v in overrides.items() if v is not None})
    except SamplingError as exc:
        text = str(exc)
        head = text.split(" = ", 1)[0].split(" ", 1)[0].strip()  # "top_p = 2 ..." or "min_frames 2 > ..."
        field_name = head if head in _PARAM_NAMES.values() or head in ("min_frames", "max_frames") else None
        p = param if field_name is None else (field_name if field_name.endswith("_frames") else f"{param}.{field_name}")
        raise ProtocolError("invalid_field", text, p) from None


# ------------------------------------------------------------------------------------------------ voices, languages

LANGUAGE_CODES = {"en": "english", "zh": "chinese", "de": "german", "it": "italian", "pt": "portuguese",
                  "es": "spanish", "ja": "japanese", "ko": "korean", "fr": "french", "ru": "russian"}


@dataclass(frozen=True)
class Catalog:
    """What the served checkpoint can speak (from engine.info): voices and languages, case-insensitive."""

    voices: tuple[str, ...]  # lower-case speaker names
    languages: tuple[str, ...]  # lower-case names, "auto" first

    def voice(self, v: Any, param: str = "voice") -> str:
        name = _name(v, param)
        if name not in self.voices:
            raise ProtocolError("unknown_voice", f"unknown voice {v!r}; voices: {', '.join(self.voices)}", param)
        return name

    def language(self, v: Any, param: str = "language") -> str:
        name = _name(v, param)
        name = LANGUAGE_CODES.get(name, name)
        if name not in self.languages:
            raise ProtocolError("unknown_language", f"unknown language {v!r}; languages: {', '.join(self.languages)} "
                                "or their ISO 639-1 codes", param)
        return name


def _name(v: Any, param: str) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ProtocolError("invalid_field", f"'{param}' must be a non-empty string", param)
    return v.strip().lower()


# ------------------------------------------------------------------------------------------------ session defaults

TRANSPORTS = ("binary", "json")
LAYOUTS = ("dual", "whole")
NORMALIZATIONS = ("llm", "none")


@dataclass(frozen=True)
class Defaults:
    """`session.created.defaults`: what a context gets for every field it does not set."""

    voice: str
    language: str = "auto"
    output_format: OutputFormat = field(default_factory=OutputFormat)
    audio_transport: str = "binary"
    text_layout: str = "dual"
    text_normalization: str = "llm"
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams overrides of the server defaults

    def to_dict(self, base: SamplingParams) -> dict:
        p = replace(base, **self.sampling)  # the overrides were validated when they were set
        sampling = {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
                    "repetition_penalty": p.repetition_penalty,
                    "subtalker": {"temperature": p.sub_temperature, "top_k": p.sub_top_k, "top_p": p.sub_top_p}}
        if "seed" in self.sampling:
            sampling["seed"] = p.seed
        return {"voice": self.voice, "language": self.language, "output_format": self.output_format.to_dict(),
                "audio_transport": self.audio_transport, "text_layout": self.text_layout,
                "text_normalization": self.text_normalization, "sampling": sampling}

    def updated(self, obj: Any, catalog: Catalog, base: SamplingParams, param: str = "defaults") -> Defaults:
        """A new Defaults with the fields of `obj` applied, all validated (nothing changes on error). `param` is
        where `obj` sits in the message; "" for the top level (a context's own fields)."""
        if not isinstance(obj, dict):
            raise ProtocolError("invalid_field", f"'{param}' must be an object, got {type_name(obj)}", param)
        at = (lambda name: f"{param}.{name}") if param else (lambda name: name)
        d = self
        for name, parse in (("voice", catalog.voice), ("language", catalog.language),
                            ("output_format", parse_output_format)):
            if obj.get(name) is not None:
                d = replace(d, **{name: parse(obj[name], at(name))})
        for name, choices in (("audio_transport", TRANSPORTS), ("text_layout", LAYOUTS),
                              ("text_normalization", NORMALIZATIONS)):
            v = get_str(obj, name, choices=choices, param=at(name))
            if v is not None:
                d = replace(d, **{name: v})
        if "sampling" in obj:  # a null field unsets that default
            over = {**d.sampling, **parse_sampling(obj["sampling"], at("sampling"))}
            over = {k: v for k, v in over.items() if v is not None}
            validate_sampling(base, over, at("sampling"))
            d = replace(d, sampling=over)
        return d


# ------------------------------------------------------------------------------------------------ contexts


@dataclass(frozen=True)
class ContextOptions:
    """Everything a context is opened with, resolved against the session defaults and validated."""

    voice: str
    language: str
    instructions: str | None
    output_format: OutputFormat
    audio_transport: str
    text_layout: str
    text_normalization: str
    sampling: SamplingParams  # seed included (given, or drawn by the caller when `seed_given` is False)
    seed_given: bool


def resolve_context_options(obj: dict, defaults: Defaults, catalog: Catalog, base: SamplingParams, *,
                            max_frames_limit: int, max_instruction_chars: int, draw_seed) -> ContextOptions:
    """`context.create` (or an HTTP request) fields over the defaults. `draw_seed()` gives a seed when none is set."""
    d = defaults.updated(obj, catalog, base, param="")
    instructions = get_str(obj, "instructions", max_chars=max_instruction_chars)
    if instructions is not None and not instructions.strip():
        instructions = None
    over = dict(d.sampling)
    max_frames = get_int(obj, "max_frames", minimum=1, maximum=max_frames_limit)
    min_frames = get_int(obj, "min_frames", minimum=0)
    if max_frames is not None:
        over["max_frames"] = max_frames
    if min_frames is not None:
        over["min_frames"] = min_frames
    elif max_frames is not None and base.min_frames > max_frames:
        over["min_frames"] = max_frames  # a default never contradicts an explicit valid max_frames
    seed_given = over.get("seed") is not None
    if not seed_given:
        over["seed"] = draw_seed()
    sampling = validate_sampling(base, over)
    if sampling.max_frames > max_frames_limit:
        raise ProtocolError("invalid_field", f"max_frames {sampling.max_frames} is above this server's limit "
                            f"{max_frames_limit}", "max_frames")
    return ContextOptions(d.voice, d.language, instructions, d.output_format, d.audio_transport, d.text_layout,
                          d.text_normalization, sampling, seed_given)
