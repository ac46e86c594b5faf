"""The asyncio facade the server uses: open contexts, feed them token ids, read their events.

Calls are cheap and never block on the model: they change scheduler state under the core's lock and wake the
loop thread. Events come back through one asyncio queue per context, in order, ending with ContextDone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable

import torch

from engine import kernels
from engine.api import (
    ContextSpec,
    EngineError,
    InvalidRequest,
    ModelInfo,
    Overloaded,
    VoiceInfo,
)
from engine.config import EngineConfig
from engine.context import OPS, EngineContext
from engine.core import EngineCore
from engine.model.checkpoint import LoadedModel
from engine.model.prompt import LAYOUTS, PromptError, instruction_ids, resolve_voice, spoken_languages
from engine.model.sampling_params import SamplingError, SamplingParams
from engine.runner import Runner, resolve_slots
from engine.scheduler import AdmissionRefused, Scheduler
from engine.trace import Timeline
from engine.types import ContextDone, EngineEvent, EngineStats, FastPath, Readiness

log = logging.getLogger("voicelane.engine")
# the contexts' events, grouped per context, and when they were handed over (time.monotonic())
HandOver = Callable[[list[tuple[EngineContext, list[EngineEvent]]], float], None]


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
        # where delivered events go: each context's event loop here; the pipe to the server in an engine process
        self.hand_over: HandOver = self._hand_to_loops
        s = self.scheduler
        self._ops = {"append_text": s.append_text, "end_segment": s.end_segment,
                     "close": functools.partial(s.end_segment, close=True), "cancel": s.cancel,
                     "playback": s.playback, "mark_audible": s.mark_audible}
        assert set(self._ops) == set(OPS), "engine.context.OPS and Engine._ops name the same operations"
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
                         first_audio_chain=self._chain_report(),
                         engine_process=FastPath(False, "off (--engine-process): the engine thread shares the server's "
                                                        "process and its GIL"))

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

    def running(self) -> bool:
        """False once the loop thread has died."""
        return self.core.crashed is None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Nothing to do in this process: each context hands its events to the loop that opened it."""

    def coalesced(self) -> contextlib.AbstractContextManager:
        """Nothing to gather in this process: every call reaches the scheduler at once (engine/remote.py's sends
        one write for what is inside)."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ contexts
    def open_context(self, spec: ContextSpec) -> EngineContext:
        loop = asyncio.get_running_loop()
        return self.admit(spec, lambda cid: EngineContext(self, cid, spec, loop))

    def open_context_pipelined(self, spec: ContextSpec) -> EngineContext:
        """open_context for a caller that can take a refusal as the context's first event (engine/remote.py); in
        this process admission is a direct call, so it is open_context: a refusal raises."""
        return self.open_context(spec)

    def admit(self, spec: ContextSpec, make: Callable[[int], EngineContext]) -> EngineContext:
        """Validate `spec` and admit it (InvalidRequest, Overloaded); `make(cid)` builds the context's handle,
        registered before any of its events can exist."""
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
        with self.core.lock:
            try:
                cid = self.scheduler.open_context(voice, spec.sampling, time.monotonic(), layout=spec.text_layout,
                                                  instruction=instruction, reports_onset=spec.reports_onset,
                                                  realtime=spec.realtime)
            except AdmissionRefused as exc:
                raise Overloaded(str(exc)) from None
            ctx = make(cid)
            self.contexts[cid] = ctx
        self.timeline.name_context(cid, spec.trace_id)
        return ctx

    def _fail_everything(self, exc: BaseException) -> None:
        """The loop died (e.g. the device failed): end every open context so no client waits forever."""
        message = f"engine stopped: {type(exc).__name__}: {exc}"
        routed = []
        for cid, ctx in list(self.contexts.items()):
            ctx.ended = True
            del self.contexts[cid]
            routed.append((ctx, [ContextDone("error", 0, "internal", message, cid=cid)]))
        self.hand_over(routed, time.monotonic())

    def submit(self, op: str, cid: int, *args) -> None:
        """A context's scheduler operation (engine.context.OPS), applied now under the core's lock."""
        with self.core.lock:
            self._ops[op](cid, *args, time.monotonic())
            events = self.scheduler.drain_outbox()
        if events:
            self._deliver(events)
        self.core.wake.set()

    def inject_fault(self, cid: int, kind: str, at_frame: int) -> None:
        self.runner.faults[cid] = (kind, at_frame)

    def end_pacing(self) -> None:
        """The server drains: hold no stream from now on (SchedulerConfig.pace_buffer_s), so that what is in flight
        finishes generating before the drain's deadline instead of at its listener's pace."""
        with self.core.lock:
            self.scheduler.pacing = False
        self.core.wake.set()

    def _deliver(self, events: list[EngineEvent]) -> None:
        """Route the scheduler's events to their contexts (called on the engine thread or inside a submit)."""
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
        if routed:
            self.hand_over(list(routed.values()), time.monotonic())

    @staticmethod
    def _hand_to_loops(routed: list[tuple[EngineContext, list[EngineEvent]]], handed: float) -> None:
        for ctx, batch in routed:
            ctx.hand_over(batch, handed)

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
