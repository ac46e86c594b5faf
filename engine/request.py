"""Request and context bookkeeping shared by the scheduler and the engine loop. Plain Python: no torch.

A context is one stream of speech on one audio timeline; each segment (text up to a flush or the close) is a
Request that moves through PREFILL -> (CODE_PREDICTOR -> TALKER)* with CODEC chunks alongside. The scheduler
advances a request's progress counters when it *plans* a step (device work is stream-ordered, so the next step
may be planned before the last one finished); facts only the host can learn late (EOS, NaN, audio) arrive
through StageResult (engine/types.py) one iteration later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.model.prompt import Prompt, Voice
from engine.model.sampling_params import SamplingParams
from engine.types import FirstAudioTimes

FRAME_S = 0.08  # one frame = 80 ms of audio


@dataclass
class PlaybackClock:
    """Where the listener's playback of a context is, from client acks or, without them, 1x from first send."""

    delivered_s: float = 0.0  # audio handed to the server so far (all segments)
    first_sent_at: float | None = None
    ack_at: float | None = None  # time of the last client report
    ack_played_s: float = 0.0
    ack_state: str = "playing"  # buffering | playing | underrun | finished
    ack_buffered_s: float | None = None  # the client's own buffer level at the last report, if it sent one
    ack_delivered_s: float = 0.0  # delivered_s at the last report
    # Leading silence the consumer's trimmer dropped (never played), and when the first audible audio was sent
    # (the consumer's onset report): without acks, playback runs 1x from there over the audio kept.
    trimmed_s: float = 0.0
    audible_sent_at: float | None = None
    ack_trimmed_s: float = 0.0  # trimmed_s at the last report (an ack's position already counts silence dropped)

    def buffer_empty_at(self) -> float | None:
        """When the listener runs out of audio (None: playback has not started, nothing delivered)."""
        if self.first_sent_at is None:
            return None
        if self.ack_at is None:
            start = self.first_sent_at if self.audible_sent_at is None else self.audible_sent_at
            return start + self.delivered_s - self.trimmed_s
        if self.ack_state in ("buffering", "underrun"):
            return self.ack_at  # the listener is waiting right now
        dropped_since = self.trimmed_s - self.ack_trimmed_s  # silence dropped after the report: never buffered
        if self.ack_buffered_s is not None:  # the player's own count, plus what was delivered since
            return self.ack_at + self.ack_buffered_s + (self.delivered_s - self.ack_delivered_s) - dropped_since
        return self.ack_at + max(0.0, self.delivered_s - self.ack_played_s - dropped_since)


@dataclass
class ContextState:
    """The scheduler's record of one open context: what it was opened with, and where it is."""

    cid: int
    slot: int  # cache row shared by the context's segments, one at a time
    sampling: SamplingParams
    voice: Voice  # resolved speaker and language
    layout: str  # "dual" (text may stream in) or "whole"
    instruction: list[int] | None = None  # ids of "user\n{instructions}" (1.7B only)
    clock: PlaybackClock = field(default_factory=PlaybackClock)
    segments_started: int = 0
    audio_samples: int = 0  # context timeline position (end of audio emitted)
    closed: bool = False  # no more text will come
    cancelled: bool = False
    failed: str | None = None
    last_reason: str = "completed"
    reports_onset: bool = False  # the consumer trims leading silence and reports each segment's audible onset
    realtime: bool = False  # the consumer plays as it comes, at 1x: pacing may hold it (SchedulerConfig.pace_buffer_s)
    lane: str | None = None  # the lane that last ran a step on the slot (two lanes: "first" or "main")


@dataclass
class Request:
    rid: int
    context: ContextState
    segment: int
    arrival: float
    layout: str
    sampling: SamplingParams  # seed already offset by the segment index
    text_ids: list[int] = field(default_factory=list)
    text_complete: bool = False
    words: int | None = None  # whitespace-separated words of the segment (benchmark length mode)
    prompt: Prompt | None = None
    # planned progress (advanced at plan time)
    prefilled: bool = False
    code0_made: int = 0  # code-0 tokens sampled (c0[0] by the prefill, c0[s+1] by TALKER(s))
    frames_made: int = 0  # frames with all 16 codes (CODE_PREDICTOR(s) makes frame s)
    frames_decoded: int = 0  # frames handed to the codec
    chunks: int = 0
    # host-known facts (one iteration late)
    code0_checked: int = 0  # code-0 tokens whose EOS flag has been read
    eos_at: int | None = None  # index of the code-0 token that was EOS
    stop_at: int | None = None  # frames the segment will have, once known
    finish_reason: str = "completed"
    frames_emitted: int = 0
    first_audio_at: float | None = None
    prefill_planned_at: float | None = None  # when the step of its prefill was planned (FirstAudioTimes)
    # Until its first audio: when the device ran each step on its way there ({stage: (start, end)}, host clock)
    # and when the work queued ahead of its prefill ended (StageResult.device_spans, ahead_done)
    first_audio_spans: dict[str, tuple[float, float]] = field(default_factory=dict)
    ahead_of_prefill_done: float | None = None
    newcomer: bool = True  # at its first text the listener had nothing left to play: it waits for this segment
    audible_at: float | None = None  # when the consumer reported the segment's first audible audio
    done: bool = False

    @property
    def slot(self) -> int:
        return self.context.slot

    def confirmed_frames(self) -> int:
        """Frames whose code 0 is known not to be EOS and whose codes exist."""
        ok = self.code0_checked if self.eos_at is None else min(self.code0_checked, self.eos_at)
        limit = self.frames_made if self.stop_at is None else min(self.frames_made, self.stop_at)
        return min(ok, limit)

    @property
    def generating(self) -> bool:
        return self.stop_at is None

    def first_audio_times(self, collected: float) -> FirstAudioTimes:
        """The record of the segment's first audio, collected now (every step before it has been planned)."""
        def span(stage: str) -> tuple[float | None, float | None]:
            return self.first_audio_spans.get(stage, (None, None))

        return FirstAudioTimes(arrival=self.arrival, prefill_planned=self.prefill_planned_at, collected=collected,
                               ahead_done=self.ahead_of_prefill_done, prefill_started=span("prefill")[0],
                               prefill_done=span("prefill")[1], code_predictor_done=span("code_predictor")[1],
                               codec_done=span("codec")[1])
