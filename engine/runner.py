"""Executes the scheduler's plans on the model. All per-slot state lives on the model's device.

The host sends small index and id tensors and gets results back through copies it only reads one iteration
later (`launch` then `collect`), so a step never waits for the device. Eager here, on the CPU and the GPU; the
CUDA-graph fast path captures these same stage functions per batch bucket.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from engine.config import MAX_SLOTS, EngineConfig, EngineConfigError
from engine.graphs import GraphCaptureError, StageGraphs
from engine.kernels.lanes import on_lane
from engine.model.checkpoint import LoadedModel
from engine.model.codec_layers import fingerprint
from engine.model.prompt import NO_CODEC
from engine.model.sampling import SamplerRows
from engine.prefix_cache import PrefixLRU
from engine.staging import HostStaging
from engine.types import RowPlan, StagePlan, StageResult, StepOutputs

log = logging.getLogger("voicelane.runner")

# max_slots = 0 (auto): what stays free of slots (captured graphs' memory pools, activations, the codec's
# workspace), beside the prefix cache's bound: a share of the memory free after the load, on a CUDA device at
# least AUTO_RESERVE_BYTES.
AUTO_RESERVE_BYTES, AUTO_RESERVE_SHARE = 8 << 30, 0.15
CPU_AUTO_SLOTS = 64  # a CPU serves a handful of streams: auto stays at the slots it always had there


def slot_bytes(loaded: LoadedModel, cfg: EngineConfig) -> int:
    """Device memory one slot holds (Runner.__init__'s per-slot tensors): the Talker's KV rows, the streaming
    codec state, the frames, the repetition mask, the hidden state and the sampling settings."""
    talker = loaded.config.talker
    stack, item = talker.stack, torch.empty((), dtype=loaded.dtype).element_size()
    kv = 2 * stack.num_layers * stack.num_kv_heads * cfg.kv_len * stack.head_dim * item
    codec = loaded.codec.state_layout.width * item + 8
    frames = (cfg.max_frames + 1) * talker.num_code_groups * 8
    return kv + codec + frames + stack.vocab_size + stack.hidden_size * item + (talker.num_code_groups + 9) * 8


def _host_available_bytes() -> int:
    """Memory the host can give without swapping: MemAvailable (page cache counts as free), else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def auto_slots(loaded: LoadedModel, cfg: EngineConfig) -> int:
    """max_slots = 0: as many slots as the device's free memory holds, beside a reserve, at most MAX_SLOTS (on
    the CPU, at most CPU_AUTO_SLOTS)."""
    per_slot, device = slot_bytes(loaded, cfg), loaded.device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cap, reserve = MAX_SLOTS, max(AUTO_RESERVE_BYTES, int(AUTO_RESERVE_SHARE * free))
    else:
        free = _host_available_bytes()
        cap, reserve = CPU_AUTO_SLOTS, int(AUTO_RESERVE_SHARE * free)
    budget = free - reserve - cfg.prefix_cache_bytes
    slots = min(cap, budget // per_slot - 1)  # one more row is the graphs' scratch slot
    if slots < 1:
        raise EngineConfigError(f"{free / 2**30:.1f} GiB free on {device} does not hold one slot of "
                                f"{per_slot / 2**20:.0f} MiB beside the reserve; lower --max-frames or "
                                "--max-prompt-tokens (they size the KV cache) or give --max-slots explicitly")
    return int(slots)


def resolve_slots(cfg: EngineConfig, loaded: LoadedModel) -> EngineConfig:
    """The config with max_slots = 0 (auto) replaced by auto_slots (logged); an explicit number stays."""
    if cfg.scheduler.max_slots:
        return cfg
    slots = auto_slots(loaded, cfg)
    log.info("max_slots auto: %d slots of %.1f MiB on %s (cap %d)", slots, slot_bytes(loaded, cfg) / 2**20,
             loaded.device, MAX_SLOTS if loaded.device.type == "cuda" else CPU_AUTO_SLOTS)
    return cfg.with_slots(slots)


class DeviceClock:
    """Maps CUDA events to the host's clock (time.monotonic()). Events measure time between one another on the
    device's clock; one event whose host time is known anchors the rest. The anchor is the last event the host
    waited for and saw complete (it completed as the wait returned, to within the wake-up, microseconds), renewed at
    every such wait, so the two clocks' drift never accumulates."""

    def __init__(self):
        self.event, self.host = None, 0.0

    def saw(self, event, now: float, waited: bool) -> None:
        """The host saw `event` complete at `now`; waited: it was not complete before the wait (so it completed
        just now). An event that was already complete anchors only while there is no better one."""
        if waited or self.event is None:
            self.event, self.host = event, now

    def host_time(self, event) -> float:
        """The host time at which `event` completed (on the anchor's side of the device's timeline)."""
        return self.host + self.event.elapsed_time(event) / 1e3


class InjectedFault(RuntimeError):
    """Raised by the test-only fault hook."""


class BadStepInput(ValueError):
    """--debug-sync: a row's device state is out of range for the step about to read it (named, row by row)."""


class _SlotSampling:
    """Sampling settings of every slot, on the device, indexed by slot: two tables, so a prefill loads a row's
    settings with two scatters, not eight."""

    FLOATS = ("temperature", "top_p", "sub_temperature", "sub_top_p", "repetition_penalty")  # SamplingParams'
    INTS = ("top_k", "sub_top_k", "seed")

    def __init__(self, slots: int, device: torch.device):
        self.floats = torch.zeros(slots, len(self.FLOATS), dtype=torch.float32, device=device)  # [S, 5]
        self.ints = torch.zeros(slots, len(self.INTS), dtype=torch.int64, device=device)  # [S, 3]

    @classmethod
    def rows(cls, params: list) -> tuple[Tensor, Tensor]:
        """The host rows of these SamplingParams: float32 [B, 5], int64 [B, 3]."""
        return (torch.tensor([[getattr(p, f) for f in cls.FLOATS] for p in params], dtype=torch.float32),
                torch.tensor([[getattr(p, f) for f in cls.INTS] for p in params], dtype=torch.int64))

    def load(self, slots: Tensor, floats: Tensor, ints: Tensor) -> None:
        self.floats[slots], self.ints[slots] = floats, ints

    # Each setting gathered on its own: the sampler kernel reads contiguous [B] columns.
    def talker(self, slots: Tensor) -> SamplerRows:
        f, i = self.floats, self.ints
        return SamplerRows(f[slots, 0], i[slots, 0], f[slots, 1], i[slots, 2])

    def code_predictor(self, slots: Tensor) -> SamplerRows:
        f, i = self.floats, self.ints
        return SamplerRows(f[slots, 2], i[slots, 1], f[slots, 3], i[slots, 2])

    def penalty(self, slots: Tensor) -> Tensor:
        return self.floats[slots, 4]


@dataclass
class Pending:
    """A launched step whose outputs are still on the device."""

    plan: StagePlan
    started: float
    parts: list[tuple[list[int], StepOutputs]] = field(default_factory=list)  # (row indices, their outputs)
    failed: dict[int, str] = field(default_factory=dict)  # row index -> reason
    elapsed_s: float = 0.0  # CPU: the launch ran the step, so its duration is known when launch returns
    start_event: object = None  # CUDA: timing events around the step's own work on the stream
    end_event: object = None
    # Where a FIRST_AUDIO step's parts end on the device: (stage, CUDA event, or host time on the CPU) for its
    # prefill and Code Predictor; the codec's end is the step's end
    marks: list[tuple[str, object]] = field(default_factory=list)
    ahead: object = None  # CUDA, one lane: the end event of the step launched before this one (queued ahead of it)


class Runner:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig):
        cfg = resolve_slots(cfg, loaded)
        self.model, self.codec, self.cfg = loaded.tts, loaded.codec, cfg
        self.device, self.dtype = loaded.device, loaded.dtype
        talker = loaded.config.talker
        # One extra scratch slot: rows that pad a batch up to its CUDA-graph bucket read and write there.
        S, dev = cfg.scheduler.max_slots + 1, self.device
        self.scratch = S - 1
        self.kv = self.model.talker.new_cache(S, cfg.kv_len, dev, self.dtype)
        self.hidden = torch.zeros(S, talker.stack.hidden_size, device=dev, dtype=self.dtype)  # [S, H]
        self.code0 = torch.zeros(S, dtype=torch.int64, device=dev)  # [S] last sampled code 0
        self.rest = torch.zeros(S, talker.num_code_groups - 1, dtype=torch.int64, device=dev)  # [S, 15]
        self.frames = torch.zeros(S, cfg.max_frames + 1, talker.num_code_groups, dtype=torch.int64, device=dev)
        self.seen = torch.zeros(S, talker.stack.vocab_size, dtype=torch.bool, device=dev)  # repetition penalty
        self.position = torch.zeros(S, dtype=torch.int64, device=dev)  # next Talker position
        self.host_position = [0] * S  # the same, known on the host without a sync (sizes attention spans)

        self.sampling = _SlotSampling(S, dev)
        self.staging = HostStaging(dev)  # every step's host inputs, pinned once (the graphs' too)
        self.codec_state = self.codec.new_stream_state(S, dev, self.dtype)
        self.faults: dict[int, tuple[str, int]] = {}  # cid -> ("exception" | "nan", code-0 index), test hook
        self.kv_bytes = self.kv.bytes
        # Keys and values of prompt prefixes ([layers, kv_heads, P, head_dim] each), valid for the weights whose
        # fingerprint is _prefix_weights: everything the prefix positions' keys and values are computed from.
        self.prefix_cache: PrefixLRU[tuple[Tensor, Tensor]] = PrefixLRU(cfg.prefix_cache_entries,
                                                                        cfg.prefix_cache_bytes)
        self._prefix_sources = [*self.model.talker.model.parameters(),
                                *self.model.talker.text_projection.parameters()]
        self._prefix_weights = fingerprint(self._prefix_sources)
        # Two lanes (SchedulerConfig.first_audio_lane): each runs on its own stream, the first-audio lane's at the
        # higher priority (a hint: the device prefers its kernels as SMs free up, it never preempts), with its own
        # graphs up to first_lane_max_batch rows (two graphs must not replay at once: they share their buffers).
        self.lanes = cfg.scheduler.first_audio_lane
        self.streams: dict[str, torch.cuda.Stream] | None = None
        if self.lanes and self.device.type == "cuda":
            self.streams = {"main": torch.cuda.Stream(dev, priority=0), "first": torch.cuda.Stream(dev, priority=-1)}
        self._joined: set[str] = set()  # lanes whose stream has waited for the work done before (load, capture)
        self._lane: str | None = None  # the lane of the step being launched
        graphs_on = cfg.graph_mode(self.device.type) != "off"
        self.graphs = StageGraphs(self, cfg) if graphs_on else None
        self.first_graphs = StageGraphs(self, cfg, lane="first") if graphs_on and self.lanes else None
        self.graph_failure: str | None = None
        self.debug_sync = cfg.debug_sync
        self._last_end_event = None  # the end of the step collected last (one lane): the device's idle gap after it
        self._last_launched_end = None  # the end of the step launched last (one lane): what the next one queues behind
        self._pending: Pending | None = None  # the step being launched (its part marks)
        # An event whose host time is known (the host saw it complete as it waited for it): events map to the host's
        # clock through it (DeviceClock)
        self.device_clock = DeviceClock()

    # ------------------------------------------------------------------ launch / collect
    def launch(self, plan: StagePlan) -> Pending:
        with self._on_lane(plan):
            return self._launch(plan)

    @contextmanager
    def _on_lane(self, plan: StagePlan):
        """Launch on the plan's lane: its stream (after the other lane's queued work if a row ran there last), its
        graphs, its kernel scratch."""
        self._lane = plan.lane
        try:
            if self.streams is None or plan.lane is None:
                with on_lane(plan.lane):
                    yield
                return
            stream = self.streams[plan.lane]
            if plan.lane not in self._joined:
                stream.wait_stream(torch.cuda.current_stream(self.device))
                self._joined.add(plan.lane)
            if plan.wait_lane is not None:
                stream.wait_stream(self.streams[plan.wait_lane])
            with torch.cuda.stream(stream), on_lane(plan.lane):
                yield
        finally:
            self._lane = None

    def ready(self, pending: Pending) -> bool:
        """Has the device finished this step (collect would not wait)?"""
        return pending.end_event is None or pending.end_event.query()

    @property
    def lane_graphs(self) -> StageGraphs | None:
        """The graphs of the lane being launched."""
        return self.first_graphs if self._lane == "first" and self.first_graphs is not None else self.graphs

    @torch.inference_mode()
    def _launch(self, plan: StagePlan) -> Pending:
        pending = Pending(plan, time.monotonic())
        if self.device.type == "cuda":
            # Launches do not wait for the step before them, so host time would count that step too: the
            # scheduler's cost model needs this step's own device time, which events around it give.
            pending.start_event = torch.cuda.Event(enable_timing=True)
            pending.start_event.record()
            pending.ahead = self._last_launched_end if self.streams is None else None
        self._pending = pending
        stage_fn = getattr(self, f"_{plan.stage.value}")

        def run(rows: list[RowPlan]) -> StepOutputs:
            if self.debug_sync:
                self.check_inputs(plan.stage.value, rows)
            # Copied out at once: the outputs may be a graph's static buffers, which its next replay (a retried
            # row, the next step) overwrites in stream order after this copy.
            return self._to_host(stage_fn(rows))

        rows = list(range(len(plan.rows)))
        try:
            pending.parts.append((rows, run(plan.rows)))
        except Exception:
            # Isolate the failing row: retry one by one, so a broken request never takes its batch down.
            for i in rows:
                try:
                    pending.parts.append(([i], run([plan.rows[i]])))
                except Exception as exc:  # noqa: BLE001 - the reason is reported to that request only
                    pending.failed[i] = f"{type(exc).__name__}: {exc}"
        if self.debug_sync and self.device.type == "cuda":
            # Diagnostics (--debug-sync): wait for this step, so a device fault is pinned on this stage and batch.
            try:
                torch.cuda.synchronize()
            except Exception:
                log.error("device fault in stage %s, rows %s", plan.stage.value,
                          [(r.cid, r.slot, r.frame, r.chunk) for r in plan.rows])
                raise
        if self.device.type == "cuda":
            pending.end_event = torch.cuda.Event(enable_timing=True)
            pending.end_event.record()
            self._last_launched_end = pending.end_event
            self.staging.seal(pending.end_event, torch.cuda.current_stream(self.device))
        else:
            pending.elapsed_s = time.monotonic() - pending.started
        self._pending = None
        return pending

    @staticmethod
    def _to_host(outputs: StepOutputs) -> StepOutputs:
        """Enqueue the copies of a step's device outputs to the host (read at collect, after the step's end)."""
        for f in fields(outputs):
            value = getattr(outputs, f.name)
            if value is not None and value.device.type == "cuda":
                setattr(outputs, f.name, value.to("cpu", non_blocking=True))
        return outputs

    def _mark(self, stage: str) -> None:
        """The part `stage` of the step being launched ends here (FIRST_AUDIO: its per-part device times)."""
        if self._pending is None:
            return
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._pending.marks.append((stage, event))
        else:
            self._pending.marks.append((stage, time.monotonic()))

    def collect(self, pending: Pending) -> StageResult:
        elapsed = pending.elapsed_s
        if pending.end_event is not None:
            finished_before = pending.end_event.query()
            pending.end_event.synchronize()
            self.device_clock.saw(pending.end_event, time.monotonic(), waited=not finished_before)
            elapsed = pending.start_event.elapsed_time(pending.end_event) / 1e3
        plan, n = pending.plan, len(pending.plan.rows)
        result = StageResult(plan.stage, [r.rid for r in plan.rows], elapsed)
        result.device_spans, result.ahead_done = self._device_spans(pending)
        if pending.end_event is not None and self.streams is None:
            # Both events have completed (this step's end was just waited for): reading them never waits.
            if self._last_end_event is not None:
                result.idle_before_s = max(0.0, self._last_end_event.elapsed_time(pending.start_event) / 1e3)
            self._last_end_event = pending.end_event
        failed: list[str | None] = [pending.failed.get(i) for i in range(n)]
        merged: dict[str, list] = {}  # StepOutputs field -> per plan row, None where no part produced it
        for rows, outputs in pending.parts:
            for f in fields(outputs):
                value = getattr(outputs, f.name)
                if value is None:
                    continue
                arr = merged.setdefault(f.name, [None] * n)
                for j, i in enumerate(rows):
                    arr[i] = value[j].numpy()
        if "bad" in merged:
            for i, bad in enumerate(merged["bad"]):
                if bad is not None and bool(bad) and failed[i] is None:
                    failed[i] = "non-finite values in the model's output"
        result.failed = failed
        if "eos" in merged:
            result.eos = [bool(x) if x is not None else False for x in merged["eos"]]
        if "pcm" in merged:
            result.pcm, result.codes = self._own_frames(plan.rows, merged["pcm"], merged["codes"])
        return result

    def _device_spans(self, pending: Pending) -> tuple[dict[str, tuple[float, float]], float | None]:
        """When each part of a collected step ran on the device, on the host's clock: {stage: (start, end)} (a
        FIRST_AUDIO step: its prefill, Code Predictor and codec), and when the work queued ahead of it ended (None:
        the CPU, two lanes, or nothing launched before it)."""
        stage = pending.plan.stage.value
        if pending.end_event is None:  # the CPU: launch ran the step; its marks are host times
            bounds = [pending.started, *(t for _, t in pending.marks), pending.started + pending.elapsed_s]
            names = [name for name, _ in pending.marks] + ["codec" if pending.marks else stage]
            return {name: (a, b) for name, a, b in zip(names, bounds[:-1], bounds[1:], strict=True)}, None
        to_host = self.device_clock.host_time
        bounds = [to_host(pending.start_event), *(to_host(e) for _, e in pending.marks), to_host(pending.end_event)]
        names = [name for name, _ in pending.marks] + ["codec" if pending.marks else stage]
        spans = {name: (a, b) for name, a, b in zip(names, bounds[:-1], bounds[1:], strict=True)}
        return spans, None if pending.ahead is None else to_host(pending.ahead)

    def _own_frames(self, rows: list[RowPlan], pcm: list, codes: list) -> tuple[list, list]:
        """Each codec row's audio and codes of its own chunk (a step of mixed chunks is padded to its largest)."""
        spf = self.codec.samples_per_frame
        return ([None if p is None else p[: r.chunk * spf] for p, r in zip(pcm, rows, strict=True)],
                [None if c is None else c[: r.chunk] for c, r in zip(codes, rows, strict=True)])

    # ------------------------------------------------------------------ diagnostics
    def check_inputs(self, stage: str, rows: list[RowPlan]) -> None:
        """Read (host sync: diagnostics only) every index a step will use and raise BadStepInput naming each row
        whose state is out of range; the launch then retries row by row, so only the bad rows fail."""
        slots = [r.slot for r in rows]
        if any(not 0 <= s < self.scratch for s in slots):
            raise BadStepInput(f"{stage} step input out of range: slots {slots} outside [0, {self.scratch})")
        index = torch.tensor(slots, device=self.device)
        talker_vocab, codebook, n_frames = self.seen.shape[1], self.codec.config.codebook_size, self.frames.shape[1]
        code0, rest = self.code0[index].tolist(), self.rest[index].tolist()
        position = self.position[index].tolist()
        codes = [self.frames[r.slot, max(r.frame, 0) : r.frame + r.chunk].tolist() for r in rows] \
            if stage == "codec" else [[] for _ in rows]
        bad = []
        for i, r in enumerate(rows):
            problems = []
            if stage in ("code_predictor", "talker") and not 0 <= code0[i] < talker_vocab:
                problems.append(f"code 0 = {code0[i]}")
            if stage == "code_predictor" and not 0 <= r.frame < n_frames:
                problems.append(f"frame {r.frame} outside [0, {n_frames})")
            if stage == "talker":
                if not all(0 <= c < codebook for c in rest[i]):
                    problems.append(f"codes 1-15 = {rest[i]}")
                if position[i] != self.host_position[r.slot] or position[i] >= self.kv.max_len:
                    problems.append(f"position device {position[i]} / host {self.host_position[r.slot]}"
                                    f" (cache {self.kv.max_len})")
            if stage == "codec":
                if r.frame < 0 or r.frame + r.chunk > n_frames:
                    problems.append(f"frames [{r.frame}, {r.frame + r.chunk}) outside [0, {n_frames})")
                elif not all(0 <= c < codebook for frame in codes[i] for c in frame):
                    problems.append(f"codes out of the codebooks in frames [{r.frame}, {r.frame + r.chunk}): "
                                    f"{codes[i]}")
            if problems:
                bad.append(f"context {r.cid} slot {r.slot} frame {r.frame}: " + "; ".join(problems))
        if bad:
            log.error("bad %s step input: %s", stage, " | ".join(bad))
            raise BadStepInput(f"{stage} step input out of range: " + " | ".join(bad))

    # ------------------------------------------------------------------ stages
    def _column(self, values: list, dtype: torch.dtype) -> Tensor:
        return self._upload(torch.tensor(values, dtype=dtype))

    def _upload(self, host: Tensor) -> Tensor:
        """Host tensor -> the device without waiting (HostStaging: a copy from pageable memory would synchronize
        the stream, the host waiting for the step in flight; from pinned memory it is queued behind it)."""
        return self.staging.upload([host])[0]

    def _upload_all(self, *hosts: Tensor) -> list[Tensor]:
        """Several host tensors -> device tensors of the same dtypes and shapes, in one copy."""
        return self.staging.upload(list(hosts))

    @staticmethod
    def _ints(values: list) -> Tensor:
        return torch.tensor(values, dtype=torch.int64)

    def _inject(self, rows: list[RowPlan], code0_index: list[int], logits: Tensor | None = None) -> None:
        """Test-only faults: before the model runs, raise for "exception" faults; once logits exist, poison the
        rows with "nan" faults."""
        for i, (row, index) in enumerate(zip(rows, code0_index, strict=True)):
            kind, at = self.faults.get(row.cid, (None, 0))
            if kind is None or index < at:
                continue
            if kind == "exception" and logits is None:
                raise InjectedFault(f"injected fault in context {row.cid}")
            if kind == "nan" and logits is not None:
                logits[i] = float("nan")

    def _use_graphs(self, rows: list[RowPlan]) -> bool:
        # Faults are injected between model calls, which a replayed graph cannot do: such batches run eagerly.
        return self.lane_graphs is not None and not any(r.cid in self.faults for r in rows)

    def _graph_or_eager(self, rows: list[RowPlan], graph_call, eager_call):
        if self._use_graphs(rows):
            try:
                return graph_call(self.lane_graphs)
            except GraphCaptureError as exc:
                self.graphs = self.first_graphs = None
                self.graph_failure = str(exc)
                log.error("CUDA graph capture FAILED, serving eagerly from now on (slow): %s", exc)
        return eager_call()

    def _prefill(self, rows: list[RowPlan]) -> StepOutputs:
        self._inject(rows, [0] * len(rows))
        lengths = [len(r.prompt) for r in rows]
        L = max(lengths)
        if L + self.cfg.max_frames + 1 > self.kv.max_len:
            raise ValueError(f"prompt of {L} positions exceeds max_prompt_tokens {self.cfg.max_prompt_tokens}")
        starts = self._load_prefixes(rows)  # positions each row's cache row holds already: only the rest runs
        T = max(n - start for n, start in zip(lengths, starts, strict=True))
        text = torch.full((len(rows), T), self.model.cfg.tts_pad_id, dtype=torch.int64)
        codec = torch.full((len(rows), T), NO_CODEC, dtype=torch.int64)
        for i, (r, start) in enumerate(zip(rows, starts, strict=True)):
            text[i, : lengths[i] - start] = torch.tensor(r.prompt.text_track[start:])
            codec[i, : lengths[i] - start] = torch.tensor(r.prompt.codec_track[start:])
        floats, ints = _SlotSampling.rows([r.sampling for r in rows])
        inputs = (self._ints([r.slot for r in rows]), text, codec, self._ints(starts), self._ints(lengths),
                  torch.tensor([r.eos_allowed for r in rows]), floats, ints)
        kv_len = min(max(starts) + T, self.kv.max_len)
        eos, bad = self._graph_or_eager(
            rows, lambda g: g.prefill(*inputs, max(starts)),
            lambda: self.prefill_step(*self._upload_all(*inputs), kv_len,
                                      on_logits=lambda lg: self._inject(rows, [0] * len(rows), lg)))
        self._keep_prefixes(rows, starts)
        for r, n in zip(rows, lengths, strict=True):
            self.host_position[r.slot] = n
        return StepOutputs(eos=eos, bad=bad)

    def _first_audio(self, rows: list[RowPlan]) -> StepOutputs:
        """PREFILL, then CODE_PREDICTOR for frame 0, then a 1-frame CODEC chunk, queued back to back: each reads
        what the one before wrote into the slots' device state, so nothing waits for the host between them. A row
        whose code 0 is EOS decodes a frame nobody keeps (the scheduler drops it)."""
        sampled = self._prefill(rows)
        self._mark("prefill")
        self._code_predictor(rows)
        self._mark("code_predictor")
        audio = self._codec(rows)
        return StepOutputs(eos=sampled.eos, bad=sampled.bad, pcm=audio.pcm, codes=audio.codes)

    # ------------------------------------------------------------------ prompt-prefix cache
    def _load_prefixes(self, rows: list[RowPlan]) -> list[int]:
        """Copy the cached keys and values of each row's prompt prefix into its cache row (one copy per distinct
        prefix in the batch). Returns per row the positions its cache row now holds: the prefix length on a hit,
        0 on a miss (the whole prompt runs, and _keep_prefixes keeps its prefix)."""
        cache = self.prefix_cache
        if not cache.enabled:
            return [0] * len(rows)
        weights = fingerprint(self._prefix_sources)
        if weights != self._prefix_weights:  # loaded, replaced, cast or written in place since: entries are stale
            log.info("the Talker's weights changed: dropping %d cached prompt prefixes", len(cache))
            cache.invalidate()
            self._prefix_weights = weights
        starts, hits = cache.find([r.prompt for r in rows])
        for (k, v), members in hits.values():  # index_copy_: no host sync (the launch never waits)
            index, P, n = self._column([rows[i].slot for i in members], torch.int64), k.shape[2], len(members)
            self.kv.k[:, :, :, :P].index_copy_(1, index, k[:, None].expand(-1, n, -1, -1, -1))
            self.kv.v[:, :, :, :P].index_copy_(1, index, v[:, None].expand(-1, n, -1, -1, -1))
        return starts

    def _keep_prefixes(self, rows: list[RowPlan], starts: list[int]) -> None:
        """After a prefill: the prefix of each row that missed is in its cache row's first columns (causal: they
        depend on the prefix alone); keep a copy of each new one."""
        def copy(i: int, prompt) -> tuple[tuple[Tensor, Tensor], int]:
            slot, P = rows[i].slot, prompt.prefix_len
            k, v = self.kv.k[:, slot, :, :P].clone(), self.kv.v[:, slot, :, :P].clone()
            return (k, v), 2 * k.numel() * k.element_size()

        self.prefix_cache.keep([r.prompt for r in rows], starts, copy)

    def sample_code0(self, slots: Tensor, logits: Tensor, frame: Tensor, allow_eos: Tensor) -> Tensor:
        return self.model.choose_code0(logits, self.sampling.talker(slots), self.sampling.penalty(slots),
                                       self.seen[slots], allow_eos, frame)

    # Step functions over static-shaped tensors, each with its own bookkeeping of the slots' device state: run
    # eagerly, or captured once per bucket by StageGraphs (rows that pad a batch to its bucket read and write the
    # scratch slot). on_logits (eager only): the test fault hook, called with the logits before sampling.
    def _flags(self, code0: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Per row: did it sample EOS, and are its logits not all finite -> eos [B] bool, bad [B] bool."""
        return code0 == self.model.eos_id, ~torch.isfinite(logits).all(dim=-1)

    def prefill_step(self, slots: Tensor, text: Tensor, codec: Tensor, start: Tensor, length: Tensor,
                     allow_eos: Tensor, floats: Tensor, ints: Tensor, kv_len: int,
                     on_logits=None) -> tuple[Tensor, Tensor]:
        """text, codec [B, T]: each row's prompt tracks from position start[b] on, right-padded; start [B]: the
        positions its cache row already holds (a cached prefix; 0: none); length [B]: the whole prompt's
        positions; floats [B, 5], ints [B, 3]: its sampling settings (_SlotSampling); kv_len: cache columns
        attended (> every prompt position). Leaves each slot's hidden state, code 0 and next position on the
        device -> eos [B], bad [B]."""
        T = text.shape[1]
        self.sampling.load(slots, floats, ints)
        self.seen.index_fill_(0, slots, False)  # a scalar fill, not a host tensor: capture-safe
        self.codec_state.reset_(slots)
        x = self.model.embed_prompt(text, codec)  # [B, T, H]
        # Padding past a row's prompt writes columns no step reads before writing them (kept inside the cache).
        positions = (start[:, None] + torch.arange(T, device=text.device)).clamp_(max=self.kv.max_len - 1)
        hidden, logits = self.model.talker(x, slots, positions, self.kv, kv_len, last=length - start - 1,
                                           valid_len=length)
        if on_logits is not None:
            on_logits(logits)
        code0 = self.sample_code0(slots, logits, torch.zeros_like(length), allow_eos)
        self.hidden[slots], self.code0[slots], self.position[slots] = hidden, code0, length
        return self._flags(code0, logits)

    def code_predictor_step(self, slots: Tensor, frame: Tensor) -> tuple[()]:
        """Codes 1-15 of each row's frame `frame` [B]: into the slots' `rest` and `frames` (nothing returned: the
        frame stays on the device, for the codec)."""
        code0 = self.code0[slots]
        rest, _ = self.model.codes_1_to_15(self.hidden[slots], code0, self.sampling.code_predictor(slots), frame)
        self.rest[slots] = rest
        self.frames[slots, frame] = torch.cat([code0[:, None], rest], dim=1)
        return ()

    def talker_step(self, slots: Tensor, text: Tensor, frame: Tensor, allow_eos: Tensor,
                    kv_len: int, on_logits=None) -> tuple[Tensor, Tensor]:
        """The next frame's code 0 of each row (text [B]: its text token id; frame [B]: that frame's index);
        advances each slot's position (not the scratch slot's, which padded rows share) -> eos [B], bad [B]."""
        code0 = self.code0[slots]
        self.seen[slots, code0] = torch.ones_like(code0, dtype=torch.bool)  # a tensor value: capture-safe
        x = self.model.next_input(code0, self.rest[slots], text)
        last = torch.zeros_like(slots)
        position = self.position[slots]
        hidden, logits = self.model.talker(x, slots, position[:, None], self.kv, kv_len, last=last)
        if on_logits is not None:
            on_logits(logits)
        code0 = self.sample_code0(slots, logits, frame, allow_eos)
        self.hidden[slots], self.code0[slots] = hidden, code0
        self.position[slots] = position + (slots != self.scratch)
        return self._flags(code0, logits)

    def codec_step(self, slots: Tensor, first: Tensor, valid: Tensor, chunk: int,
                   mixed: bool = True) -> tuple[Tensor, Tensor]:
        """Each row's frames [first, first + valid) [B] from the slots' frames, padded to `chunk` by repeating its
        last frame (audio nobody keeps; mixed=False: every row has `chunk` frames) -> pcm [B, chunk * 1920] fp32,
        codes [B, chunk, 16]."""
        offsets = torch.arange(chunk, device=slots.device)
        index = first[:, None] + (torch.minimum(offsets, valid[:, None] - 1) if mixed else offsets)  # [B, chunk]
        codes = self.frames[slots[:, None], index]  # [B, chunk, 16]
        pcm = self.codec.decode_stream(codes.transpose(1, 2), self.codec_state, slots,
                                       valid=valid if mixed else None)
        return pcm.float(), codes

    def _code_predictor(self, rows: list[RowPlan]) -> StepOutputs:
        inputs = self._ints([r.slot for r in rows]), self._ints([r.frame for r in rows])
        self._graph_or_eager(rows, lambda g: g.code_predictor(*inputs),
                             lambda: self.code_predictor_step(*self._upload_all(*inputs)))
        return StepOutputs()  # the frame stays on the device, for the codec

    def _talker(self, rows: list[RowPlan]) -> StepOutputs:
        self._inject(rows, [r.frame + 1 for r in rows])
        inputs = (self._ints([r.slot for r in rows]), self._ints([r.text_id for r in rows]),
                  self._ints([r.frame + 1 for r in rows]), torch.tensor([r.eos_allowed for r in rows]))
        kv_len = max(self.host_position[r.slot] for r in rows) + 1
        eos, bad = self._graph_or_eager(
            rows, lambda g: g.talker(*inputs, kv_len),
            lambda: self.talker_step(*self._upload_all(*inputs), kv_len,
                                     on_logits=lambda lg: self._inject(rows, [r.frame + 1 for r in rows], lg)))
        for r in rows:
            self.host_position[r.slot] += 1
        return StepOutputs(eos=eos, bad=bad)

    def _codec(self, rows: list[RowPlan]) -> StepOutputs:
        """Rows of different chunk sizes run padded to the largest, each decoding its own (collect cuts the
        padding off): a shorter row repeats its last frame, which the codec decodes into audio nobody keeps."""
        chunks = [r.chunk for r in rows]
        chunk = max(chunks)
        inputs = self._ints([r.slot for r in rows]), self._ints([r.frame for r in rows]), self._ints(chunks)
        pcm, codes = self._graph_or_eager(
            rows, lambda g: g.codec(*inputs, chunk),
            lambda: self.codec_step(*self._upload_all(*inputs), chunk, mixed=min(chunks) < chunk))
        return StepOutputs(pcm=pcm, codes=codes)
