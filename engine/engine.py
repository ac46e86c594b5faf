"""The asyncio facade the server uses: open contexts, feed them token ids, read their events.

Calls are cheap and never block on the model: they change scheduler state under the core's lock and wake the
loop thread. Events come back through one asyncio queue per context, in order, ending with ContextDone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import torch

from engine import kernels
from engine.api import (
    ContextClosed,
    ContextSpec,
    EngineError,
    InvalidRequest,
    ModelInfo,
    Overloaded,
    VoiceInfo,
)
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model.checkpoint import LoadedModel
from engine.model.prompt import LAYOUTS, PromptError, instruction_ids, resolve_voice, spoken_languages
from engine.model.sampling_params import SamplingError, SamplingParams
from engine.runner import Runner, resolve_slots
from engine.scheduler import AdmissionRefused, Scheduler
from engine.trace import Timeline
from engine.types import AudioChunk, ContextDone, EngineEvent, EngineStats, FastPath, Readiness

log = logging.getLogger("voicelane.engine")
PLAYBACK_STATES = ("buffering", "playing", "underrun", "finished")


class EngineContext:
    """The engine's handle on one open context (one stream of speech), made by Engine.open_context."""

    def __init__(self, engine: Engine, cid: int, spec: ContextSpec, loop: asyncio.AbstractEventLoop):
        self.engine, self.cid, self.spec = engine, cid, spec
        self._queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self._loop = loop
        self.closed = False  # no more text
        self.ended = False  # ContextDone was delivered
        self.backlog_samples = 0  # audio delivered to the queue but not yet read by events(): a slow reader's debt
        self.segment_tokens = 0  # text tokens of the open segment
        self.audible_segment = -1  # the last segment reported audible (one scheduler call per segment)
        # prompt positions besides the text (engine/model/prompt.py): the wrapped instruction, the role (3), the
        # codec tags with the speaker (at most 6), then tts_eos and the codec_bos position (2)
        instruction = len(spec.instruction_ids) + 3 if spec.instruction_ids else 0
        self.prompt_overhead = instruction + 3 + 6 + 2

    @property
    def seed(self) -> int:
        return self.spec.sampling.seed

    def _op(self, fn, *args):
        if self.ended:
            raise ContextClosed("the context has ended")
        return self.engine._call(fn, self.cid, *args)

    def append_text(self, ids: list[int]) -> None:
        if self.closed:
            raise ContextClosed("text after context.close")
        if not ids:
            return
        if self.spec.text_layout == "whole":  # the whole segment goes into the prompt: refuse what cannot fit
            limit = self.engine.config.max_prompt_tokens - self.prompt_overhead
            if self.segment_tokens + len(ids) > limit:
                raise InvalidRequest("text_too_long", f"a whole-text segment may hold {limit} tokens (this one would "
                                     f"reach {self.segment_tokens + len(ids)}); flush earlier, use text_layout "
                                     "'dual', or raise --max-prompt-tokens", "text")
        self._op(self.engine.scheduler.append_text, list(ids))
        self.segment_tokens += len(ids)

    def flush(self, words: int | None = None) -> int | None:
        """End the current segment. Returns its index, or None if there was no text since the last flush."""
        if self.closed:
            raise ContextClosed("flush after context.close")
        self.segment_tokens = 0
        return self._op(self.engine.scheduler.end_segment, words)

    def close(self, words: int | None = None) -> int | None:
        if self.closed:
            raise ContextClosed("context.close twice")
        self.closed = True
        return self._op(lambda cid, w, now: self.engine.scheduler.end_segment(cid, w, now, close=True), words)

    def cancel(self) -> None:
        if not self.ended:
            self.engine._call(self.engine.scheduler.cancel, self.cid)

    def report_playback(self, played_ms: float, state: str, buffered_ms: float | None = None) -> None:
        """Where the listener is: played_ms on the context timeline, the player's state and, if the client knows
        it, how much audio its buffer holds (more exact than delivered - played, which counts audio in flight)."""
        if state not in PLAYBACK_STATES:
            raise InvalidRequest("invalid_field", f"state {state!r}; one of {PLAYBACK_STATES}", "state")
        if not self.ended:
            buffered = None if buffered_ms is None else float(buffered_ms)
            self.engine._call(self.engine.scheduler.playback, self.cid, float(played_ms), state, buffered)

    def mark_audible(self, segment: int) -> None:
        """The consumer's leading-silence trimmer found this segment's audible onset: the segment leaves the
        first-audio class (spec.reports_onset). Cheap to call for every chunk after the onset."""
        if segment > self.audible_segment and not self.ended:
            self.audible_segment = segment
            self.engine._call(self.engine.scheduler.mark_audible, self.cid, segment)

    def inject_fault(self, kind: str, at_frame: int = 0) -> None:
        """Test hook: make this context's model step fail ("exception") or produce NaN logits ("nan")."""
        self.engine.runner.faults[self.cid] = (kind, at_frame)

    async def events(self) -> AsyncIterator[EngineEvent]:
        while True:
            event = await self._queue.get()
            if isinstance(event, AudioChunk):
                self.backlog_samples -= len(event.pcm)
            yield event
            if isinstance(event, ContextDone):
                return

    def _push(self, events: list[EngineEvent], handed: float | None = None) -> None:
        """On the event loop: queue events the engine thread handed over at `handed` (time.monotonic())."""
        received = time.monotonic()
        for e in events:
            if isinstance(e, AudioChunk):
                self.backlog_samples += len(e.pcm)
                if e.first_audio is not None:  # a segment's first audio: its trip to the loop is part of its TTFA
                    e = replace(e, first_audio=replace(e.first_audio, handed=handed, received=received))
            self._queue.put_nowait(e)


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.config.validate()
        self.config = resolve_slots(self.config, loaded)  # max_slots 0 (auto): from the device's free memory
        self.loaded = loaded
        self.timeline = Timeline(self.config.trace_capacity, origin=time.monotonic())
        self.scheduler = Scheduler(self.config.scheduler, loaded.config, self.timeline)
        self.runner = Runner(loaded, self.config)
        # A CPU step runs inside launch, so there is no device time to plan into: late planning is for CUDA.
        lead = self.config.scheduler.plan_lead_s if self.runner.device.type == "cuda" else 0.0
        self.core = EngineCore(self.scheduler, self.runner, self._deliver, self.timeline, plan_lead_s=lead)
        self.core.on_crash = self._fail_everything
        self.contexts: dict[int, EngineContext] = {}
        self.sampling_defaults = SamplingParams.from_generation_config(loaded.config.generation).with_overrides(
            max_frames=min(2048, self.config.max_frames))
        self.info = self._model_info()
        self.warmed_up = False
        mode = self.config.graph_mode(loaded.device.type)
        why_off = "CPU device" if loaded.device.type != "cuda" else "cuda_graphs=off"
        self.graph_report = FastPath(False, "not captured yet (warmup() captures them)" if mode != "off" else
                                     f"off ({why_off}): eager PyTorch")
        log.info("engine ready: %d slots, KV cache %.1f MiB, prefix cache %s, device %s, dtype %s",
                 self.config.scheduler.max_slots, self.runner.kv_bytes / 2**20,
                 f"{self.config.prefix_cache_entries} entries / {self.config.prefix_cache_mib:g} MiB"
                 if self.runner.prefix_cache.enabled else "off", loaded.device, loaded.dtype)
        if self.config.scheduler.first_audio_chain:
            log.info("first-audio chain on: a segment starts with one step (prefill, frame 0, its 1-frame chunk) "
                     "while that step is predicted within max_step_s (%g ms)", self.config.scheduler.max_step_s * 1e3)

    def _model_info(self) -> ModelInfo:
        cfg = self.loaded.config
        langs = spoken_languages(cfg)
        voices = [VoiceInfo(name, ["auto", *langs]) for name in cfg.talker.speaker_ids]
        name = self.loaded.source.rstrip("/").split("/")[-1] if not self.loaded.random_weights else self.loaded.source
        return ModelInfo(name=name, model_size=cfg.model_size, voices=voices, languages=["auto", *langs],
                         supports_instructions=cfg.supports_instructions, random_weights=self.loaded.random_weights,
                         sampling_defaults=self.sampling_defaults)

    # ------------------------------------------------------------------ lifecycle
    def capture_graphs(self) -> None:
        """Capture every CUDA graph now. A failure is logged loudly, reported by readiness(), and the engine
        runs eagerly: never a silent fallback."""
        graphs = self.runner.graphs
        if graphs is None:
            return
        try:
            with torch.inference_mode():
                count, seconds = graphs.capture_all()
                if self.runner.first_graphs is not None:
                    lane_count, lane_seconds = self.runner.first_graphs.capture_all()
                    count, seconds = count + lane_count, seconds + lane_seconds
                    log.info("first-audio lane: %d of these graphs, batches %s", lane_count,
                             list(self.runner.first_graphs.buckets))
            self.graph_report = FastPath(enabled=graphs.mode == "cuda", mode=graphs.mode, graphs=count,
                                         capture_s=round(seconds, 2), batch_buckets=list(graphs.buckets),
                                         attention_buckets=list(graphs.kv_buckets), codec_chunks=list(graphs.chunks),
                                         prefill_batches=list(graphs.prefill_buckets),
                                         prefill_lengths=list(graphs.prefill_lengths),
                                         prefill_eager_above=max(graphs.prefill_lengths, default=0))
            log.info("captured %d graphs (%s) in %.1f s", count, graphs.mode, seconds)
        except Exception as exc:  # noqa: BLE001 - reported, then served eagerly
            self.runner.graphs = self.runner.first_graphs = None
            self.graph_report = FastPath(False, f"capture failed: {type(exc).__name__}: {exc}")
            log.error("CUDA graph capture FAILED, serving eagerly (slow): %s", exc)

    def warmup(self, frames: int = 4) -> float:
        """Capture graphs, then run one short utterance through every stage before serving (first-call costs
        stay out of TTFA), twice: the second prefill takes its prompt prefix from the prefix cache, so that path
        has run too. Call before start(). Returns the seconds it took."""
        t0 = time.monotonic()
        self.capture_graphs()
        voice = resolve_voice(self.loaded.config, next(iter(self.loaded.config.talker.speaker_ids)), "auto")
        sampling = self.sampling_defaults.with_overrides(max_frames=frames, min_frames=0)
        for _ in range(2 if self.runner.prefix_cache.enabled else 1):
            with self.core.lock:
                cid = self.scheduler.open_context(voice, sampling, t0)
                self.scheduler.append_text(cid, [9707, 11, 1879, 0], t0)  # "Hello, world!"
                self.scheduler.end_segment(cid, 2, t0, close=True)
            self.core.run_until_idle()
        with self.core.lock:
            self.scheduler.drain_outbox()
            self.scheduler.costs.reset()  # first-call costs must not steer admission
        self.warmed_up = True
        return time.monotonic() - t0

    def readiness(self) -> Readiness:
        """What /ready reports: which fast paths are in use, and why not where they are not."""
        graphs = (self.graph_report if self.runner.graph_failure is None else
                  FastPath(False, f"capture failed: {self.runner.graph_failure}"))
        return Readiness(model_loaded=True, warmed_up=self.warmed_up, engine_running=self.core.crashed is None,
                         device=str(self.loaded.device), dtype=str(self.loaded.dtype).replace("torch.", ""),
                         cuda_graphs=graphs, triton_kernels=self._kernels_report(),
                         random_weights=self.loaded.random_weights, first_audio_lane=self._lane_report(),
                         first_audio_chain=self._chain_report())

    def _chain_report(self) -> FastPath:
        if not self.config.scheduler.first_audio_chain:
            return FastPath(False, "off (--first-audio-chain): a segment starts with three steps")
        why = self.scheduler.chain_gave_way
        return FastPath(why is None, why)

    def _lane_report(self) -> FastPath:
        runner = self.runner
        if not runner.lanes:
            return FastPath(False, "off (--first-audio-lane): newcomers share the one stream with playing streams")
        first = runner.first_graphs
        buckets = None if first is None else list(first.buckets)
        if runner.streams is None:
            return FastPath(True, "CPU device: the lanes alternate on the engine thread, no streams",
                            batch_buckets=buckets)
        graphs = None if first is None else first.pf.count + first.cp.count + first.tk.count + first.cd.count
        return FastPath(True, mode="cuda streams (first-audio lane priority -1, main 0)", graphs=graphs,
                        batch_buckets=buckets)

    def _kernels_report(self) -> FastPath:
        status = kernels.kernels_status()
        device = self.loaded.device
        if device.type != "cuda":
            return FastPath(False, "CPU device: the PyTorch path", details=status)
        if status["cuda_kernels"] != "triton":
            why = status["triton_error"] or f"{kernels.ENV}={status['choice']}"
            return FastPath(False, f"the unfused PyTorch path ({why})", details=status)
        kernels.pdl(device)  # decided (and reported below) even before a launch asks
        return FastPath(True, details=kernels.kernels_status())

    def start(self) -> None:
        self.core.start()

    def stop(self) -> None:
        self.core.stop()

    # ------------------------------------------------------------------ contexts
    def open_context(self, spec: ContextSpec) -> EngineContext:
        cfg = self.loaded.config
        try:
            voice = resolve_voice(cfg, spec.voice, spec.language)
            instruction = instruction_ids(cfg, spec.instruction_ids) if spec.instruction_ids else None
        except PromptError as exc:
            raise InvalidRequest(exc.code, str(exc), exc.param) from None
        if spec.text_layout not in LAYOUTS:
            raise InvalidRequest("invalid_field", f"text_layout {spec.text_layout!r}; one of {LAYOUTS}", "text_layout")
        try:
            spec.sampling.validate()
        except SamplingError as exc:
            raise InvalidRequest("invalid_field", str(exc), "sampling") from None
        if spec.sampling.max_frames > self.config.max_frames:
            raise InvalidRequest("invalid_field", f"max_frames {spec.sampling.max_frames} is above this server's "
                                 f"limit {self.config.max_frames}", "max_frames")
        if self.core.crashed is not None:
            raise EngineError(f"the engine has stopped ({type(self.core.crashed).__name__}); restart the server")
        loop = asyncio.get_running_loop()
        with self.core.lock:
            try:
                cid = self.scheduler.open_context(voice, spec.sampling, time.monotonic(), layout=spec.text_layout,
                                                  instruction=instruction, reports_onset=spec.reports_onset)
            except AdmissionRefused as exc:
                raise Overloaded(str(exc)) from None
            ctx = EngineContext(self, cid, spec, loop)
            self.contexts[cid] = ctx
        self.timeline.name_context(cid, spec.trace_id)
        return ctx

    def _fail_everything(self, exc: BaseException) -> None:
        """The loop died (e.g. the device failed): end every open context so no client waits forever."""
        message = f"engine stopped: {type(exc).__name__}: {exc}"
        for cid, ctx in list(self.contexts.items()):
            ctx.ended = True
            del self.contexts[cid]
            done = ContextDone("error", 0, "internal", message, cid=cid)
            ctx._loop.call_soon_threadsafe(ctx._push, [done])

    def _call(self, fn, cid: int, *args):
        with self.core.lock:
            out = fn(cid, *args, time.monotonic())
            events = self.scheduler.drain_outbox()
        if events:
            self._deliver(events)
        self.core.wake.set()
        return out

    def _deliver(self, events: list[EngineEvent]) -> None:
        """Route the scheduler's events to the contexts' queues (called on the engine thread or inside a call)."""
        routed: dict[int, tuple[EngineContext, list[EngineEvent]]] = {}
        for e in events:
            ctx = self.contexts.get(e.cid)
            if ctx is None:
                continue
            routed.setdefault(e.cid, (ctx, []))[1].append(e)
            if isinstance(e, ContextDone):
                ctx.ended = True
                self.runner.faults.pop(e.cid, None)
                del self.contexts[e.cid]
        handed = time.monotonic()
        for ctx, batch in routed.values():
            ctx._loop.call_soon_threadsafe(ctx._push, batch, handed)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        with self.core.lock:
            s = self.scheduler.stats()
        stages = {k: v.snapshot() for k, v in self.core.stage_stats.items()}
        return EngineStats(**vars(s), stages=stages, kv_cache_bytes=self.runner.kv_bytes,
                           open_contexts=len(self.contexts), max_slots=self.config.scheduler.max_slots,
                           prefix_cache=self.runner.prefix_cache.stats(), loop=self.core.loop_stats.snapshot())

    def chrome_trace(self) -> str:
        return self.timeline.chrome_trace()
