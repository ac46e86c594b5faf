"""Test-only access to the official qwen-tts 0.1.1 package, used as a parity oracle on the CPU.

`import qwen_tts` drags in audio libraries (sox, onnxruntime, torchaudio, librosa, soundfile) that the
CustomVoice talker, code predictor and 12 Hz decoder never use; where they are missing we register empty
modules in their place before the import. Nothing in engine/ or server/ imports this file.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

_HEAVY = ("sox", "onnxruntime", "torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi",
          "librosa", "librosa.filters", "soundfile")


def _unavailable(*_args, **_kwargs):
    raise RuntimeError("a stubbed audio dependency of qwen_tts was called")


def _register_empty(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    # transformers calls importlib.util.find_spec() on some names; a module without a spec breaks it.
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules[name] = module
    return module


def _importable(name: str) -> bool:
    try:
        __import__(name)
        return True
    except Exception:
        return False


def install_stubs() -> None:
    if "qwen_tts" in sys.modules:
        return
    for top in ("sox", "onnxruntime"):
        if not _importable(top):
            _register_empty(top)
    if not _importable("torchaudio.compliance.kaldi"):
        ta, comp, kaldi = (_register_empty(n) for n in _HEAVY[2:5])
        ta.compliance, comp.kaldi = comp, kaldi
    if not _importable("librosa"):
        lb, filters = _register_empty("librosa"), _register_empty("librosa.filters")
        filters.mel = _unavailable
        lb.filters, lb.load, lb.resample = filters, _unavailable, _unavailable
    if not _importable("soundfile"):
        _register_empty("soundfile").__dict__.update(read=_unavailable, write=_unavailable)


def modeling():
    """The official modeling module (talker, code predictor, generate)."""
    install_stubs()
    from qwen_tts.core.models import modeling_qwen3_tts

    return modeling_qwen3_tts


def codec_modeling():
    """The official 12 Hz tokenizer modeling module (codec decoder)."""
    install_stubs()
    from qwen_tts.core.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2

    return modeling_qwen3_tts_tokenizer_v2
