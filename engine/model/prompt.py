"""CustomVoice prompts: voices, languages, and the two-track prompt layout the Talker reads.

Every prompt position is text_embedding(text id) projected, plus (for the codec part) one codec embedding, so a
prompt is just two id lists; embeddings are made on the device by the runner. Layout (docs/model.md 3.2):

  [instruction] <|im_start|>user\\n{instruction}<|im_end|>\\n     text only (1.7B only)
  [role]        <|im_start|> assistant \\n                          text only
  [codec]       think, think_bos, lang, think_eos, speaker, pad     + tts_pad (tts_bos on the last)
                (language auto: nothink, think_bos, think_eos, speaker, pad)
  dual-track:   text[0] + codec_bos; decode step s then reads text[s+1], tts_eos, tts_pad, tts_pad ...
  whole text:   text[i] + codec_pad for every i, tts_eos + codec_pad, tts_pad + codec_bos; steps read tts_pad
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model.config import ModelConfig

NO_CODEC = -1
USER_ID, NEWLINE_ID = 872, 198  # Qwen2 BPE ids of "user" and "\n"

LANGUAGE_CODES = {"en": "english", "zh": "chinese", "de": "german", "it": "italian", "pt": "portuguese",
                  "es": "spanish", "ja": "japanese", "ko": "korean", "fr": "french", "ru": "russian"}
LAYOUTS = ("dual", "whole")


class PromptError(ValueError):
    """Bad voice, language, instruction or layout. `code` is the protocol's error code."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(frozen=True)
class Voice:
    speaker: str  # lower-case checkpoint speaker name
    speaker_id: int  # codec id of the speaker's embedding row
    language: str  # lower-case language name, or "auto"
    language_id: int | None  # codec id used in the prompt (dialect speakers override chinese/auto)


def spoken_languages(cfg: ModelConfig) -> list[str]:
    """The checkpoint's languages a client may name (dialects are reached through their speakers)."""
    dialects = {d for d in cfg.talker.speaker_dialect.values() if d}
    return [name for name in cfg.talker.language_ids if name not in dialects]


def resolve_voice(cfg: ModelConfig, voice: str, language: str = "auto") -> Voice:
    t = cfg.talker
    speaker = (voice or "").strip().lower()
    if speaker not in t.speaker_ids:
        raise PromptError("unknown_voice", f"unknown voice {voice!r}; voices: {sorted(t.speaker_ids)}", "voice")
    lang = (language or "auto").strip().lower()
    lang = LANGUAGE_CODES.get(lang, lang)
    if lang != "auto" and lang not in spoken_languages(cfg):
        raise PromptError("unknown_language", f"unknown language {language!r}; languages: auto, "
                          f"{', '.join(spoken_languages(cfg))} or their ISO 639-1 codes", "language")
    language_id = None if lang == "auto" else t.language_ids[lang]
    dialect = t.speaker_dialect.get(speaker)
    if dialect and lang in ("chinese", "auto"):
        language_id = t.language_ids[dialect]
    return Voice(speaker, t.speaker_ids[speaker], lang, language_id)


def instruction_ids(cfg: ModelConfig, instruction_body_ids: list[int]) -> list[int]:
    """ids of "<|im_start|>user\\n{instruction}<|im_end|>\\n", given the ids of "user\\n{instruction}"."""
    if not cfg.supports_instructions:
        raise PromptError("invalid_field", "instructions are not supported by the 0.6B model; "
                          "drop 'instructions' or serve the 1.7B CustomVoice checkpoint", "instructions")
    return [cfg.im_start_id, *instruction_body_ids, cfg.im_end_id, NEWLINE_ID]


@dataclass(frozen=True)
class Prompt:
    text_track: list[int]  # text id per position
    codec_track: list[int]  # codec id per position, NO_CODEC where the position is text only
    # Leading positions that do not depend on the text (instruction, role, codec tags with language and speaker):
    # their keys and values are the same in every prompt that opens with the same ids (engine/prefix_cache.py)
    prefix_len: int = 0

    def __len__(self) -> int:
        return len(self.text_track)

    def prefix_key(self) -> tuple | None:
        """What the prefix's keys and values depend on: the ids of both tracks before the text (None: no prefix,
        or nothing after it)."""
        if not 0 < self.prefix_len < len(self):
            return None
        return tuple(self.text_track[: self.prefix_len]), tuple(self.codec_track[: self.prefix_len])


def build_prompt(cfg: ModelConfig, voice: Voice, text_ids: list[int], layout: str = "dual",
                 instruction: list[int] | None = None) -> Prompt:
    """The prefill. Dual-track needs only text_ids[0]; the whole-text layout needs all of the text."""
    if layout not in LAYOUTS:
        raise PromptError("invalid_field", f"text_layout {layout!r}; use 'dual' or 'whole'", "text_layout")
    if not text_ids:
        raise PromptError("invalid_field", "a prompt needs at least one text token", "text")
    t = cfg.talker
    text: list[int] = list(instruction or [])
    codec: list[int] = [NO_CODEC] * len(text)
    text += [cfg.im_start_id, cfg.assistant_id, NEWLINE_ID]
    codec += [NO_CODEC] * 3
    if voice.language_id is None:
        tags = [t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id]
    else:
        tags = [t.codec_think_id, t.codec_think_bos_id, voice.language_id, t.codec_think_eos_id]
    head = [*tags, voice.speaker_id, t.codec_pad_id]
    codec += head
    text += [cfg.tts_pad_id] * (len(head) - 1) + [cfg.tts_bos_id]
    prefix_len = len(text)  # everything so far is the same for any text: the prefix both layouts share
    if layout == "dual":
        text.append(text_ids[0])
        codec.append(t.codec_bos_id)
    else:
        text += [*text_ids, cfg.tts_eos_id, cfg.tts_pad_id]
        codec += [t.codec_pad_id] * (len(text_ids) + 1) + [t.codec_bos_id]
    return Prompt(text, codec, prefix_len)


def text_track_id(cfg: ModelConfig, text_ids: list[int], step: int, layout: str, text_complete: bool) -> int | None:
    """Text id added to the Talker's input at decode step `step`, or None when it has not arrived yet."""
    if layout == "whole":
        return cfg.tts_pad_id
    nxt = step + 1
    if nxt < len(text_ids):
        return text_ids[nxt]
    if not text_complete:
        return None
    return cfg.tts_eos_id if nxt == len(text_ids) else cfg.tts_pad_id
