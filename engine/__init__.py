"""The engine's public surface: the names code outside engine/ (the server, tools, tests of the server) may import.

Importing the package loads no torch, so the server starts, parses its flags and serves its errors without it (and,
with the engine in a process of its own, serves without it). The one name that needs torch, `Engine`, is imported on
first use (PEP 562); a type hint that names it goes under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from engine.api import (
    SAMPLE_RATE,
    SAMPLES_PER_FRAME,
    ContextClosed,
    ContextSpec,
    EngineError,
    InvalidRequest,
    ModelInfo,
    Overloaded,
    VoiceInfo,
)
from engine.config import MAX_SLOTS, EngineConfig, EngineConfigError, SchedulerConfig
from engine.context import EngineContext
from engine.model.sampling_params import SamplingError, SamplingParams
from engine.model_source import (
    DTYPES,
    RANDOM_NOTICE,
    RANDOM_SIZES,
    TINY_RANDOM,
    ModelSourceError,
    is_random,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_dtype_name,
    set_cpu_threads,
)
from engine.remote import EngineProcessError, RemoteEngine
from engine.text.tokenizer import TextTokenizer
from engine.types import (
    AudioChunk,
    ContextDone,
    EngineEvent,
    EngineStats,
    FastPath,
    FirstAudioTimes,
    LoopStats,
    PrefixCacheStats,
    Readiness,
    SegmentDone,
    StageStats,
)

if TYPE_CHECKING:
    from engine.engine import Engine

_NEEDS_TORCH = {"Engine": ("engine.engine", "Engine")}


def __getattr__(name: str):
    if name in _NEEDS_TORCH:
        module, attribute = _NEEDS_TORCH[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = [
    "DTYPES",
    "MAX_SLOTS",
    "RANDOM_NOTICE",
    "RANDOM_SIZES",
    "SAMPLES_PER_FRAME",
    "SAMPLE_RATE",
    "TINY_RANDOM",
    "AudioChunk",
    "ContextClosed",
    "ContextDone",
    "ContextSpec",
    "Engine",
    "EngineConfig",
    "EngineConfigError",
    "EngineContext",
    "EngineError",
    "EngineProcessError",
    "EngineEvent",
    "EngineStats",
    "FastPath",
    "FirstAudioTimes",
    "InvalidRequest",
    "ModelInfo",
    "ModelSourceError",
    "Overloaded",
    "LoopStats",
    "PrefixCacheStats",
    "Readiness",
    "RemoteEngine",
    "SamplingError",
    "SamplingParams",
    "SchedulerConfig",
    "SegmentDone",
    "StageStats",
    "TextTokenizer",
    "VoiceInfo",
    "is_random",
    "load_model",
    "resolve_device",
    "resolve_dtype",
    "resolve_dtype_name",
    "set_cpu_threads",
]
