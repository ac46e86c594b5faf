"""The engine's step contracts: what crosses each edge inside the engine, and what leaves it. Plain Python: no torch.

One utterance's path, and who produces and who consumes each type:

    Scheduler.plan            -> StagePlan (one Stage, a RowPlan per request in the batch)
    Runner.launch(StagePlan)  -> Pending (engine/runner.py): the step queued on the device, its StepOutputs (device
                                 tensors, copied to the host without waiting) per group of rows
    Runner.collect(Pending)   -> StageResult: the StepOutputs of every row, merged and read on the host, one
                                 iteration after the launch (engine/core.py runs plan -> launch -> collect the
                                 step before -> update)
    Scheduler.update(StageResult) -> the events, in order: AudioChunk per codec chunk, SegmentDone per segment
                                 (flush), ContextDone once at the end (Scheduler.cancel / fail / end_segment emit
                                 theirs through Scheduler.drain_outbox). Each carries the engine context id `cid`.
    Engine._deliver(events)   -> each context's asyncio queue; EngineContext.events() (engine/engine.py) yields them
                                 to the server unchanged, ending with ContextDone.

Beside the data path, what the server reads about the engine: Scheduler.stats() -> SchedulerStats, which
Engine.stats() extends into EngineStats with the loop's StageStats (/metrics, the test-state hook), and
Engine.readiness() -> Readiness with a FastPath per fast path (/ready). Their `to_json()` is the JSON the server
writes, key for key.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # annotations only: the scheduler and the loop import this module without torch
    import numpy as np
    from torch import Tensor

    from engine.model.prompt import Prompt
    from engine.model.sampling_params import SamplingParams


class Stage(str, enum.Enum):
    PREFILL = "prefill"
    CODE_PREDICTOR = "code_predictor"
    TALKER = "talker"
    CODEC = "codec"
    # A newcomer's whole first-audio chain as one step: PREFILL, CODE_PREDICTOR for frame 0 and a 1-frame CODEC
    # chunk, launched back to back with no host round trip between them (SchedulerConfig.first_audio_chain)
    FIRST_AUDIO = "first_audio"


# ---------------------------------------------------------------------------------------------- plans (scheduler)
@dataclass(frozen=True)
class RowPlan:
    """One request's row in a step, as the scheduler planned it (its progress counters already advanced)."""

    rid: int  # request (segment) id: the StageResult row is matched back to the request by it
    cid: int  # context (the test-only fault hook is keyed by it)
    slot: int  # cache row on the device
    # PREFILL and FIRST_AUDIO 0; CODE_PREDICTOR s (makes frame s); TALKER s (reads frame s, samples c0[s+1]);
    # CODEC the first frame it decodes
    frame: int
    prompt: Prompt | None = None  # PREFILL, FIRST_AUDIO
    sampling: SamplingParams | None = None  # PREFILL, FIRST_AUDIO: loaded into the slot's device state
    text_id: int | None = None  # TALKER: text-track id of this step
    eos_allowed: bool = True  # PREFILL / FIRST_AUDIO / TALKER: may the code-0 sampled now be EOS
    chunk: int = 0  # CODEC: frames decoded; FIRST_AUDIO 1


@dataclass(frozen=True)
class StagePlan:
    """One engine step: one stage over a batch of rows. CODEC rows may decode different numbers of frames (each
    its RowPlan.chunk): the step runs padded to the largest."""

    stage: Stage
    rows: list[RowPlan]
    lane: str | None = None  # "first" (the first-audio lane) or "main"; None: the engine runs one lane
    wait_lane: str | None = None  # the device first waits for the work queued on this lane (a row last ran there)


# ---------------------------------------------------------------------------------------------- runner outputs
@dataclass
class StepOutputs:
    """What one stage function returns for a batch of rows, first on the device, then (launch) on the host side.
    A field the stage does not produce stays None."""

    eos: Tensor | None = None  # PREFILL / FIRST_AUDIO / TALKER: bool [B], the sampled code 0 is EOS
    bad: Tensor | None = None  # PREFILL / FIRST_AUDIO / TALKER: bool [B], the logits held a non-finite value
    # CODEC / FIRST_AUDIO: float32 [B, chunk * 1920], chunk = the step's largest (collect cuts rows)
    pcm: Tensor | None = None
    codes: Tensor | None = None  # CODEC / FIRST_AUDIO: int64 [B, chunk, 16], the codes the audio was decoded from


# ---------------------------------------------------------------------------------------------- step results
@dataclass
class StageResult:
    """A collected step, per row of its plan (rows in plan order), read by Scheduler.update."""

    stage: Stage
    rids: list[int]  # the plan's rows
    elapsed_s: float  # the step's own device time (the cost model learns from it)
    eos: list[bool] | None = None  # PREFILL / FIRST_AUDIO / TALKER: the sampled code 0 was EOS
    failed: list[str | None] | None = None  # per row: why it failed (NaN logits, exception), else None
    # CODEC / FIRST_AUDIO: per row float32 [chunk * 1920] (None: the row failed)
    pcm: list[np.ndarray | None] | None = None
    codes: list[np.ndarray | None] | None = None  # CODEC / FIRST_AUDIO: per row int64 [chunk, 16], its own chunk
    # How long the device sat idle between the step collected before this one and this one's start: the host had not
    # queued it yet (CUDA events, one lane; None on the CPU, with two lanes, or for the first step)
    idle_before_s: float | None = None
    # When the step's parts ran on the device, on the host's clock (time.monotonic()): {stage: (start, end)}, one
    # entry for a one-stage step, three for FIRST_AUDIO (prefill, code_predictor, codec). Each request's first
    # audio is cut into phases at these points (FirstAudioTimes)
    device_spans: dict[str, tuple[float, float]] | None = None
    ahead_done: float | None = None  # when the device finished the work queued ahead of this step (None: unknown)


# ---------------------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class FirstAudioTimes:
    """Where a segment's first audio was when, on the engine's clock (time.monotonic(), the scheduler's `now`):
    the points that cut its time to first audio into phases (the server's voicelane_first_audio_phase_seconds).
    Only a segment's first AudioChunk carries one. The scheduler fills the engine thread's points; the engine adds
    the hand-off to the event loop and its receipt there (EngineContext._push)."""

    arrival: float  # the segment's first text reached the scheduler (Request.arrival)
    prefill_planned: float  # the step holding its PREFILL row (or its FIRST_AUDIO chain) was planned
    collected: float  # its first chunk's audio was collected on the engine thread (Request.first_audio_at)
    # The device's points (StageResult.device_spans; None where not known): the work queued ahead of its prefill
    # ended, its prefill started and ended, its frame 0's Code Predictor ended, its first codec chunk ended
    ahead_done: float | None = None
    prefill_started: float | None = None
    prefill_done: float | None = None
    code_predictor_done: float | None = None
    codec_done: float | None = None
    handed: float | None = None  # Engine._deliver handed it to the event loop (engine thread)
    received: float | None = None  # the event loop took it into the context's queue


@dataclass(frozen=True)
class AudioChunk:
    """Audio of one codec chunk of one segment."""

    pcm: np.ndarray  # float32 [n] at SAMPLE_RATE, n = frames * SAMPLES_PER_FRAME
    start_sample: int  # offset on the context's timeline (all segments back to back)
    segment: int  # 0, 1, ...
    first_frame: int  # frame index within the segment of pcm[0]
    codes: np.ndarray  # int64 [frames, 16]: the codes this audio was decoded from
    cid: int = 0  # engine context id (1, 2, ...): which EngineContext's queue the event goes to
    first_audio: FirstAudioTimes | None = None  # the segment's first chunk only: when it passed each point


@dataclass(frozen=True)
class SegmentDone:
    """A segment's last audio has been emitted."""

    segment: int
    reason: str  # "completed" (EOS or bench length), "max_frames"
    frames: int  # frames the segment had
    end_sample: int  # context timeline position after this segment's last sample
    cid: int = 0  # engine context id


@dataclass(frozen=True)
class ContextDone:
    """The context's last event: nothing follows it."""

    reason: str  # "completed", "max_frames", "cancelled", "error", "refused" (admission, when it was not a call)
    audio_samples: int  # context timeline length: every sample emitted, all segments
    # with reason "error": the protocol code (synthesis_failed, internal); "refused": overloaded or the invalid
    # field's code (error_param names the field)
    error_code: str | None = None
    error_message: str | None = None
    cid: int = 0  # engine context id
    error_param: str | None = None


EngineEvent = AudioChunk | SegmentDone | ContextDone


# ---------------------------------------------------------------------------------------------- stats
@dataclass
class StageStats:
    """Cumulative counters of one stage (the loop's, engine/core.py), and a step-time histogram, for /metrics."""

    BUCKETS_S: ClassVar[tuple[float, ...]] = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0,
                                              float("inf"))

    steps: int = 0
    rows: int = 0  # rows / steps = mean batch size
    seconds: float = 0.0  # device time, all steps
    last_batch: int = 0  # rows of the last step
    histogram: list[int] = field(default_factory=lambda: [0] * len(StageStats.BUCKETS_S))  # steps per bucket

    def add(self, rows: int, seconds: float) -> None:
        self.steps += 1
        self.rows += rows
        self.seconds += seconds
        self.last_batch = rows
        self.histogram[next(i for i, b in enumerate(self.BUCKETS_S) if seconds <= b)] += 1

    def snapshot(self) -> StageStats:
        return StageStats(self.steps, self.rows, self.seconds, self.last_batch, list(self.histogram))


@dataclass
class LoopStats:
    """The engine loop's own time (engine/core.py), cumulative: where a step's wall time goes besides the device's
    work. Host time is the engine thread planning, launching and bookkeeping, without its waits (for the device, for
    late planning); on a CPU a launch computes its step, so there it includes the model's work."""

    BUCKETS_S: ClassVar[tuple[float, ...]] = (0.00005, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, float("inf"))

    iterations: int = 0  # steps launched
    host_s: float = 0.0  # planning + launching + bookkeeping, all steps
    idle_s: float = 0.0  # device idle between consecutive steps (StageResult.idle_before_s), all steps
    idle_gaps: int = 0  # steps whose idle gap was measured
    idle_histogram: list[int] = field(default_factory=lambda: [0] * len(LoopStats.BUCKETS_S))  # gaps per bucket

    def add_idle(self, seconds: float) -> None:
        self.idle_s += seconds
        self.idle_gaps += 1
        self.idle_histogram[next(i for i, b in enumerate(self.BUCKETS_S) if seconds <= b)] += 1

    def snapshot(self) -> LoopStats:
        return LoopStats(self.iterations, self.host_s, self.idle_s, self.idle_gaps, list(self.idle_histogram))


@dataclass
class SchedulerStats:
    """The scheduler's counts now (Scheduler.stats)."""

    contexts: int  # open in the scheduler
    requests: int  # live segments (queued or generating)
    free_slots: int  # cache rows no context holds
    waiting_first_audio: int  # active segments with text and no audio yet
    text_starved: int  # generating segments waiting for more text
    queue_depth: dict[str, int]  # stage name -> active segments runnable at it now
    pacing: bool  # real-time streams may be held at light load (SchedulerConfig.pace_buffer_s; off once draining)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class PrefixCacheStats:
    """The prompt-prefix cache's counters (engine/prefix_cache.py): lookups are per prefill row."""

    hits: int = 0  # rows whose prefix keys and values were copied in, not computed
    misses: int = 0  # rows that computed their whole prompt (their prefix is then kept)
    evictions: int = 0  # entries dropped to stay within the bounds
    invalidations: int = 0  # times every entry was dropped because the weights changed
    entries: int = 0
    bytes: int = 0
    max_entries: int = 0  # the bounds (0: the cache is off)
    max_bytes: int = 0


@dataclass
class EngineStats(SchedulerStats):
    """Engine.stats(): the scheduler's counts, then the loop's and the engine's (the JSON keeps this order)."""

    stages: dict[str, StageStats]  # stage name -> counters, for the stages that have run
    kv_cache_bytes: int
    open_contexts: int  # EngineContext objects whose ContextDone has not been delivered
    max_slots: int = 0  # cache rows (the configured or the memory-derived number)
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    loop: LoopStats = field(default_factory=LoopStats)


# ---------------------------------------------------------------------------------------------- readiness
@dataclass(frozen=True)
class FastPath:
    """Whether one fast path is in use, and why not where it is not. The fields after `reason` describe captured
    CUDA graphs; to_json() leaves out the fields that are None."""

    enabled: bool
    reason: str | None = None  # why it is off (or how it runs instead)
    mode: str | None = None  # "cuda" (captured) or "emulate" (bucketed padding, no capture)
    graphs: int | None = None  # graphs captured
    capture_s: float | None = None
    batch_buckets: list[int] | None = None
    attention_buckets: list[int] | None = None
    codec_chunks: list[int] | None = None
    prefill_batches: list[int] | None = None
    prefill_lengths: list[int] | None = None
    prefill_eager_above: int | None = None  # prompts longer than this prefill eagerly
    details: dict | None = None  # the Triton kernels: engine.kernels.kernels_status() (PDL, the GEMM table)

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Readiness:
    """Engine.readiness(): what /ready reports about the engine."""

    model_loaded: bool
    warmed_up: bool  # warmup() ran: graphs captured, every stage run once
    engine_running: bool  # False once the loop thread has died
    device: str
    dtype: str  # "bfloat16", "float32", ...
    cuda_graphs: FastPath
    triton_kernels: FastPath  # the model's fused kernels (attention, norms, GEMMs, sampler) on the device
    random_weights: bool
    # the first-audio lane (newcomers on a stream of their own); None: not reported (the tests' fake engines)
    first_audio_lane: FastPath | None = None
    # the first-audio chain (a segment's first three steps as one), and why not where it gave way; None: the same
    first_audio_chain: FastPath | None = None
    # the engine in a process of its own (--engine-process), or sharing the server's; None: the same as above
    engine_process: FastPath | None = None

    def to_json(self) -> dict:
        out = asdict(self)
        out["cuda_graphs"], out["triton_kernels"] = self.cuda_graphs.to_json(), self.triton_kernels.to_json()
        for name in ("first_audio_lane", "first_audio_chain", "engine_process"):
            path = getattr(self, name)
            if path is None:
                del out[name]
            else:
                out[name] = path.to_json()
        return out
