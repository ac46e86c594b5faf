"""Engine configuration: one frozen tree, validated at start-up with errors that name the value and the fix."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


class EngineConfigError(ValueError):
    pass


MAX_SLOTS = 128  # the most slots max_slots = 0 (auto) gives, where the device's memory holds their KV cache rows


@dataclass(frozen=True)
class SchedulerConfig:
    # concurrent segment requests (KV cache rows); 0 = auto: the Engine sizes it from the device's free memory, at
    # most MAX_SLOTS (engine/runner.py auto_slots); a Scheduler alone (the simulator) takes MAX_SLOTS
    max_slots: int = 0
    # talker, code_predictor, codec: the largest graph bucket (128), so every stream steps in one batch, not two
    max_batch: dict[str, int] = field(default_factory=lambda: {"prefill": 16, "talker": MAX_SLOTS,
                                                               "code_predictor": MAX_SLOTS, "codec": MAX_SLOTS})
    # codec frames per chunk: first chunk, then growing. Three 1-frame chunks first: after one 80 ms chunk a 2-frame
    # chunk leaves no room for another newcomer's first-audio chain, so every ramping stream would outrank it
    chunk_ramp: tuple[int, ...] = (1, 1, 1, 2, 4, 8, 12)
    safety_lead_s: float = 0.25  # a playing stream turns urgent this long before its buffer would run dry
    admission_load: float = 0.85  # admit while the predicted round of all streams fits in this share of 80 ms
    max_waiting_first_audio: int = 32  # requests still waiting for their first audio (beyond: overloaded)
    max_step_s: float = 0.02  # a step predicted longer is split (a newcomer waits for the step in flight); 0 = off
    bench_frames_per_word: int = 0  # PROTOCOL 1.6 benchmark length mode; 0 = off
    # "first_audio": requests whose listener waits for its first audible audio run ahead of playing streams
    # unless a playing stream would run dry (docs/engine.md, Policy); "edf": one deadline axis for both (the
    # policy before issue 13, kept to compare in the simulator)
    policy: str = "first_audio"
    # The first-audio class ends at the consumer's onset report; a stream that reports none (a lost report, a
    # segment of silence) leaves it after this much audio, the server trimmer's own cap (max_trim_ms)
    first_audio_max_s: float = 2.0
    # A codec step takes every runnable row whose own chunk is no larger than its anchor's, padded to the anchor's
    # chunk (each row decodes its own frames); False: only rows of the anchor's chunk size (kept to compare in the
    # simulator: when many streams ramp together, uniform chunks fragment the codec batches)
    mix_codec_chunks: bool = True
    # refuse a newcomer whose own predicted first audio is later than this (first_audio policy; 0 = off)
    admission_first_audio_s: float = 0.25
    # Plan a step this long before the device is predicted to finish the one it runs, not as soon as the one
    # before it is collected: a request that arrives then waits for the running step only, not also for a
    # queued one planned without it. Covers the host's plan and launch (0.26-0.42 ms a step measured with the
    # engine in its own process, so 1 ms leaves twice that for jitter), else the device idles. The simulator on
    # the H200 profile (docs/engine.md "Policy"): 5 -> 2 ms cut p95 first audio by about 0.5-1 ms at 10 and 20
    # RPS, 2 -> 1 ms by 0.6 / 0.9 / 0.6 ms at 1 / 10 / 20 RPS. Used where steps run asynchronously (CUDA, the
    # simulator); 0 = plan at once.
    plan_lead_s: float = 0.001
    # A second lane for first audio: the steps of requests in the first-audio class (and every prefill) are
    # planned and launched on their own high-priority CUDA stream, beside the playing streams' steps, so a
    # newcomer never queues behind a running step (issue 13 item 3). Its batches hold at most first_lane_max_batch
    # rows (its own CUDA graphs are captured up to that bucket). Off: one lane, one stream.
    first_audio_lane: bool = False
    first_lane_max_batch: int = 4
    # A newcomer's prefill, its frame 0's Code Predictor and its first 1-frame codec chunk as one step
    # (Stage.FIRST_AUDIO): launched back to back, collected once, so no host round trip (collect, plan, launch)
    # sits between them (issue 13 item 3). Its batches hold at most max_batch["prefill"] rows. Off: three steps.
    first_audio_chain: bool = True
    # Collect a step that makes a segment's first audio as soon as the device has finished it, before planning and
    # launching the next step (the one-step-late loop would launch the next one first: its host time, a
    # millisecond or more with the server beside it on one GIL, would count into that first audio). The device
    # idles meanwhile. One lane only.
    collect_first_audio_at_once: bool = True
    # Pacing: at light load (at most pace_max_contexts open; 0 = half the slots) and with nothing urgent, a playing
    # stream whose listener has at least pace_buffer_s of audio buffered waits instead of running ahead, so the
    # device idles (a newcomer finds it free) and the streams' steps batch together. 0 = off (work-conserving).
    pace_buffer_s: float = 0.0
    pace_max_contexts: int = 0

    @property
    def slots(self) -> int:
        """max_slots, with auto (0) read as MAX_SLOTS: what a Scheduler built without an Engine uses."""
        return self.max_slots or MAX_SLOTS

    def validate(self) -> None:
        if self.max_slots < 0:
            raise EngineConfigError(f"max_slots = {self.max_slots}; use 0 (auto: from the device's memory, at most "
                                    f"{MAX_SLOTS}) or a number of slots >= 1 (--max-slots)")
        for stage in ("prefill", "talker", "code_predictor", "codec"):
            if self.max_batch.get(stage, 0) < 1:
                raise EngineConfigError(f"max_batch[{stage!r}] = {self.max_batch.get(stage)}; it must be >= 1")
        if not self.chunk_ramp or any(c < 1 for c in self.chunk_ramp):
            raise EngineConfigError(f"chunk_ramp = {self.chunk_ramp}; give positive frame counts, e.g. 1,2,4,8,12")
        if self.safety_lead_s < 0:
            raise EngineConfigError(f"safety_lead_s = {self.safety_lead_s}; it must be >= 0")
        if not 0 < self.admission_load:
            raise EngineConfigError(f"admission_load = {self.admission_load}; it must be > 0 (1.0 = full GPU)")
        if self.max_step_s < 0:
            raise EngineConfigError(f"max_step_s = {self.max_step_s}; use 0 (off) or a step length in seconds")
        if self.policy not in ("first_audio", "edf"):
            raise EngineConfigError(f"policy = {self.policy!r}; use 'first_audio' or 'edf'")
        if self.first_audio_max_s < 0 or self.admission_first_audio_s < 0:
            raise EngineConfigError(f"first_audio_max_s = {self.first_audio_max_s}, admission_first_audio_s = "
                                    f"{self.admission_first_audio_s}; both must be >= 0")
        if self.pace_buffer_s < 0 or self.pace_max_contexts < 0:
            raise EngineConfigError(f"pace_buffer_s = {self.pace_buffer_s}, pace_max_contexts = "
                                    f"{self.pace_max_contexts}; use 0 (off; half the slots) or more")
        if self.plan_lead_s < 0:
            raise EngineConfigError(f"plan_lead_s = {self.plan_lead_s}; use 0 (plan at once) or seconds")
        if self.first_audio_lane and self.policy != "first_audio":
            raise EngineConfigError("first_audio_lane needs policy 'first_audio' (the lane serves that class)")
        if self.first_lane_max_batch < 1:
            raise EngineConfigError(f"first_lane_max_batch = {self.first_lane_max_batch}; it must be >= 1")
        if self.bench_frames_per_word < 0:
            raise EngineConfigError(f"bench_frames_per_word = {self.bench_frames_per_word}; use 0 (off) or more")


@dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_frames: int = 2048  # per segment; also sizes the Talker KV cache
    max_prompt_tokens: int = 1024  # prompt positions a segment may use (whole layout: the whole text)
    trace_capacity: int = 10000  # timeline events kept per engine for the Chrome trace export
    cuda_graphs: str = "auto"  # auto (on for CUDA devices), on, off, emulate (bucketed padding without capture)
    debug_sync: bool = False  # wait for the device after every step (slow): pins a device fault on its stage
    # Prompt prefixes whose keys and values are kept on the device (engine/prefix_cache.py), least recently used
    # out first; 0 in either bound turns the cache off. An entry is about 1.2 MB on the 1.7B model in bf16 (10
    # positions of 114,688 B), more with an instruction.
    prefix_cache_entries: int = 256
    prefix_cache_mib: float = 256.0

    def validate(self) -> None:
        self.scheduler.validate()
        if self.max_frames < 1:
            raise EngineConfigError(f"max_frames = {self.max_frames}; it must be >= 1")
        if self.cuda_graphs not in ("auto", "on", "off", "emulate"):
            raise EngineConfigError(f"cuda_graphs = {self.cuda_graphs!r}; use auto, on, off or emulate")
        if self.max_prompt_tokens < 16:
            raise EngineConfigError(f"max_prompt_tokens = {self.max_prompt_tokens}; it must be >= 16")
        if self.prefix_cache_entries < 0 or self.prefix_cache_mib < 0:
            raise EngineConfigError(f"prefix_cache_entries = {self.prefix_cache_entries}, prefix_cache_mib = "
                                    f"{self.prefix_cache_mib}; use 0 (off) or more (--prefix-cache-entries, "
                                    "--prefix-cache-mib)")

    def graph_mode(self, device_type: str) -> str:
        """"cuda" (capture graphs), "emulate" (same bucketing, run eagerly) or "off"."""
        if self.cuda_graphs == "emulate":
            return "emulate"
        if self.cuda_graphs == "off" or (self.cuda_graphs == "auto" and device_type != "cuda"):
            return "off"
        if device_type != "cuda":
            raise EngineConfigError(f"cuda_graphs = 'on' needs a CUDA device, not {device_type!r}; use auto or off")
        return "cuda"

    @property
    def kv_len(self) -> int:
        return self.max_prompt_tokens + self.max_frames + 1

    @property
    def prefix_cache_bytes(self) -> int:
        return int(self.prefix_cache_mib * 2**20)

    def with_slots(self, slots: int) -> EngineConfig:
        return replace(self, scheduler=replace(self.scheduler, max_slots=slots))
