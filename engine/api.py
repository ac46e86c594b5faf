"""The engine's public names: what the server may import (docs/engine.md, rules of the house 1).

Text crosses in as token ids; audio leaves as float32 PCM chunks at 24 kHz, in order, tagged with their sample
offset on the context's timeline. A context is one stream of speech; each flush ends a segment, and every
segment is generated as its own request (fresh KV and codec state, seed = context seed + segment index). The
events a context yields (AudioChunk, SegmentDone, ContextDone) are step contracts and live in engine/types.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.model.sampling_params import SamplingParams

SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920


class EngineError(Exception):
    """A typed failure the server maps onto its protocol error table. `code` is the protocol's code."""

    code = "internal"
    retryable = False

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Overloaded(EngineError):
    """Admission refused: the engine predicts it cannot serve this context without hurting playing streams."""

    code = "overloaded"
    retryable = True


class InvalidRequest(EngineError):
    """Bad voice, language, instruction, layout or sampling value; `code` is set per case."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message, param)
        self.code = code


class ContextClosed(EngineError):
    code = "context_closed"


@dataclass(frozen=True)
class ContextSpec:
    """Everything fixed when a context opens."""

    voice: str  # checkpoint speaker name, case-insensitive
    language: str = "auto"  # language name, ISO 639-1 code or "auto"
    instruction_ids: list[int] | None = None  # ids of "user\n{instructions}" (1.7B only)
    text_layout: str = "dual"  # "dual" (text may stream in) or "whole" (all text before the first frame)
    sampling: SamplingParams = field(default_factory=SamplingParams)  # seed, min/max frames included
    trace_id: str = ""  # carried into the engine's timeline and logs
    # the consumer trims leading silence and calls EngineContext.mark_audible at each segment's onset: until then the
    # segment keeps first-audio priority (a consumer that does not report keeps it until the first chunk)
    reports_onset: bool = False
    # the consumer plays the audio as it comes, at 1x (a live listener, not a file being written): at light load
    # pacing (SchedulerConfig.pace_buffer_s) may hold the stream while its listener has enough buffered
    realtime: bool = False


@dataclass(frozen=True)
class VoiceInfo:
    name: str
    languages: list[str]


@dataclass(frozen=True)
class ModelInfo:
    name: str  # served model name (checkpoint directory name or random:<size>)
    model_size: str  # "1b7" / "0b6"
    voices: list[VoiceInfo]
    languages: list[str]  # names, plus "auto"
    supports_instructions: bool
    random_weights: bool
    sampling_defaults: SamplingParams
    sample_rate: int = SAMPLE_RATE
