"""CUDA graphs for the per-step stages: one captured graph per batch bucket (and size key), replayed with static
input buffers. A batch is padded up to its bucket; padded rows point at a scratch slot, so whatever they compute
lands where no request reads. A batch larger than the largest bucket is split, never run eagerly.

With `capture=False` the same padding and bucketing run eagerly (the CPU tests use that to check the logic).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.kernels.lanes import on_lane
from engine.model.prompt import NO_CODEC
from engine.staging import HostStaging, PackLayout

log = logging.getLogger("voicelane.graphs")


class GraphCaptureError(RuntimeError):
    """A stage could not be captured; the runner then serves eagerly and says so (log and /ready)."""

CAPTURED_STAGES = ("prefill", "code_predictor", "talker", "codec")  # the stages with graphs of their own
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# Positions a prefill graph runs (the prompt after a cached prefix: one in the dual layout); longer ones (long
# whole-layout text) prefill eagerly, as /ready says.
PREFILL_LENGTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    return buckets[-1]


@dataclass
class _Captured:
    graph: object  # torch.cuda.CUDAGraph, or None when running eagerly
    inputs: dict[str, Tensor]  # static input buffers, first dim = bucket: views of `block`
    outputs: tuple[Tensor, ...]  # static outputs of the last replay
    block: Tensor  # uint8, on the device: every static input, so that one copy fills them all
    layout: PackLayout  # where each input sits in `block` (in `inputs`' order)


class GraphBank:
    """Graphs of one stage function `fn(key, **inputs) -> tuple[Tensor, ...]`, keyed by (bucket, extra key)."""

    def __init__(self, name: str, fn: Callable[..., tuple[Tensor, ...]], make_inputs: Callable[[int, object], dict],
                 pad_values: dict[str, float | int], capture: bool, *, staging: HostStaging, pool=None,
                 lane: str | None = None, capture_stream=None):
        self.name, self.fn, self.make_inputs, self.pad_values = name, fn, make_inputs, pad_values
        self.staging = staging
        self.capture = capture
        self.pool = pool
        # A second lane's graphs are captured on a stream of their own: cuBLAS keeps a workspace per stream, and
        # graphs captured on one stream would share it while the two lanes replay at once.
        self.lane, self.capture_stream = lane, capture_stream
        self.entries: dict[tuple[int, object], _Captured] = {}

    def _entry(self, bucket: int, key: object) -> _Captured:
        entry = self.entries.get((bucket, key))
        if entry is None:
            initial = self.make_inputs(bucket, key)
            layout = PackLayout.of(list(initial.values()))
            block = torch.empty(layout.total, dtype=torch.uint8, device=next(iter(initial.values())).device)
            inputs = dict(zip(initial, layout.views(block), strict=True))
            for name, value in initial.items():
                inputs[name].copy_(value)
            if not self.capture:
                entry = _Captured(None, inputs, (), block, layout)
            else:
                with on_lane(self.lane):
                    entry = self._capture(inputs, key, bucket, block, layout)
            self.entries[(bucket, key)] = entry
        return entry

    def _capture(self, inputs: dict[str, Tensor], key: object, bucket: int, block: Tensor,
                 layout: PackLayout) -> _Captured:
        stream = self.capture_stream or torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: lazy init, autotuning, allocator
                self.fn(key, **inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
                outputs = self.fn(key, **inputs)
        except Exception as exc:
            raise GraphCaptureError(f"{self.name} graph (batch {bucket}, key {key}): "
                                    f"{type(exc).__name__}: {exc}") from exc
        return _Captured(graph, inputs, outputs, block, layout)

    def run(self, bucket: int, key: object, n: int, values: dict[str, Tensor]) -> tuple[Tensor, ...]:
        """Write the n real rows (host tensors) and the padding into a staging block laid out as the static inputs,
        copy it to them in one go, replay; returns views of the first n rows."""
        entry = self._entry(bucket, key)
        staged = self.staging.take(entry.layout.total)
        for name, view in zip(entry.inputs, entry.layout.views(staged), strict=True):
            view[:n].copy_(values[name])
            if n < bucket:
                view[n:].fill_(self.pad_values.get(name, 0))
        entry.block.copy_(staged, non_blocking=True)
        if entry.graph is None:
            outputs = self.fn(key, **entry.inputs)
        else:
            entry.graph.replay()
            outputs = entry.outputs
        return tuple(o[:n] for o in outputs)

    def run_split(self, buckets: tuple[int, ...], key: object, values: dict[str, Tensor]) -> tuple[Tensor, ...]:
        """Run a batch of any size: pieces of the largest bucket, then the rest padded to its bucket."""
        n = next(iter(values.values())).shape[0]
        if n <= buckets[-1]:  # one replay: its static outputs, which the caller copies out before the next replay
            return self.run(bucket_for(n, buckets), key, n, values)
        parts = []
        for start in range(0, n, buckets[-1]):
            piece = {k: v[start : start + buckets[-1]] for k, v in values.items()}
            m = next(iter(piece.values())).shape[0]
            # Replays of one graph share output buffers: copy out before the next piece runs.
            parts.append(tuple(o.clone() for o in self.run(bucket_for(m, buckets), key, m, piece)))
        return tuple(torch.cat(col) for col in zip(*parts, strict=True))

    @property
    def count(self) -> int:
        return len(self.entries)


class StageGraphs:
    """The runner's prefill, Code Predictor loop, Talker decode step and streaming codec step as graphs per bucket.

    Talker graphs are also keyed by a bucket of attention length (keys attended); codec graphs by chunk size, and
    they take each row's real frames (`valid`): a step whose rows decode different chunks, or a final chunk
    shorter than a ramp size, is padded to a ramp size with frames whose audio is cut off and which never reach
    the stream's state (padded rows decode one frame into the scratch slot); prefill graphs by a bucket of the
    positions they run (a prompt after its cached prefix; padded positions are masked by each row's length, and
    the cache columns they fill are overwritten before any step reads them). A prefill graph attends
    `prefill_span` cache columns (the largest length bucket), so a row may start after a cached prefix as long as
    prefix + bucket fit in it."""

    def __init__(self, runner, cfg, lane: str | None = None):
        """lane "first": the first-audio lane's own graphs, up to first_lane_max_batch rows, captured on a stream
        of their own; None: the engine's (main lane's) graphs."""
        mode = cfg.graph_mode(runner.device.type)
        capture = mode == "cuda"
        self.mode, self.lane = mode, lane
        self.staging = runner.staging
        if capture and not torch.backends.cudnn.benchmark:
            # Let cuDNN time its algorithms for each codec conv shape; the warm-up runs before each capture do the
            # search, so captured graphs replay the fastest algorithm.
            torch.backends.cudnn.benchmark = True
            log.info("cuDNN autotuning (torch.backends.cudnn.benchmark) switched on before graph capture")
        slots = cfg.scheduler.max_slots
        # The per-step stages never batch more rows than their max_batch: no graph above it.
        largest = min(slots, max(cfg.scheduler.max_batch[s] for s in ("talker", "code_predictor", "codec")))
        lane_rows = cfg.scheduler.first_lane_max_batch if lane == "first" else slots
        largest = min(largest, lane_rows)
        self.buckets = tuple(b for b in DEFAULT_BUCKETS if b < largest) + (largest,)
        self.kv_max = kv_max = runner.kv.max_len
        self.kv_buckets = tuple(sorted({min(b, kv_max) for b in (256, 512, 1024, 2048, 4096)} | {kv_max}))
        self.chunks = tuple(sorted(set(cfg.scheduler.chunk_ramp)))
        self.samples_per_frame = runner.codec.samples_per_frame
        # Each graph gets its own memory pool: graphs sharing one must replay in capture order, ours do not.
        pool = None
        own = {"lane": lane, "capture_stream": torch.cuda.Stream(runner.device) if capture and lane else None,
               "pool": pool, "staging": runner.staging}
        dev, scratch = runner.device, runner.scratch
        sampling_floats, sampling_ints = runner.sampling.floats.shape[1], runner.sampling.ints.shape[1]

        def slots_and(extra):
            return lambda B, key: {"slots": torch.full((B,), scratch, dtype=torch.int64, device=dev), **extra(B, key)}

        def i64(B):
            return torch.zeros(B, dtype=torch.int64, device=dev)

        self.cp = GraphBank("code_predictor", lambda key, slots, frame: runner.code_predictor_step(slots, frame),
                            slots_and(lambda B, key: {"frame": i64(B)}), {"slots": scratch}, capture, **own)
        self.tk = GraphBank(
            "talker", lambda key, slots, text, frame, allow_eos: runner.talker_step(slots, text, frame, allow_eos, key),
            slots_and(lambda B, key: {"text": i64(B), "frame": i64(B),
                                      "allow_eos": torch.zeros(B, dtype=torch.bool, device=dev)}),
            {"slots": scratch}, capture, **own)
        prefill_max = min(cfg.scheduler.max_batch["prefill"], slots, lane_rows)
        self.prefill_buckets = tuple(b for b in DEFAULT_BUCKETS if b < prefill_max) + (prefill_max,)
        self.prefill_lengths = tuple(n for n in PREFILL_LENGTHS if n <= cfg.max_prompt_tokens)
        self.prefill_span = min(max(self.prefill_lengths, default=0), kv_max)
        self.text_pad = runner.model.cfg.tts_pad_id
        self.eager_prefill = runner.prefill_step  # prompts longer than the largest length bucket
        self.pf = GraphBank(
            "prefill", lambda key, slots, text, codec, start, length, allow_eos, floats, ints: runner.prefill_step(
                slots, text, codec, start, length, allow_eos, floats, ints, self.prefill_span),
            slots_and(lambda B, key: {"text": torch.full((B, key), self.text_pad, dtype=torch.int64, device=dev),
                                      "codec": torch.full((B, key), NO_CODEC, dtype=torch.int64, device=dev),
                                      "start": i64(B), "length": torch.ones(B, dtype=torch.int64, device=dev),
                                      "allow_eos": torch.zeros(B, dtype=torch.bool, device=dev),
                                      "floats": torch.zeros(B, sampling_floats, dtype=torch.float32, device=dev),
                                      "ints": torch.zeros(B, sampling_ints, dtype=torch.int64, device=dev)}),
            {"slots": scratch, "text": self.text_pad, "codec": NO_CODEC, "start": 0, "length": 1}, capture, **own)
        self.cd = GraphBank(
            "codec", lambda key, slots, first, valid: runner.codec_step(slots, first, valid, key),
            slots_and(lambda B, key: {"first": i64(B), "valid": torch.ones(B, dtype=torch.int64, device=dev)}),
            {"slots": scratch, "valid": 1}, capture, **own)

    # Each stage takes its inputs as host tensors: run_split writes them into the graph's static inputs in one copy.
    def prefill(self, slots: Tensor, text: Tensor, codec: Tensor, start: Tensor, length: Tensor, allow_eos: Tensor,
                floats: Tensor, ints: Tensor, max_start: int) -> tuple[Tensor, ...]:
        """Prompt positions (after each row's cached prefix, `start`) right-padded to a length bucket; beyond the
        largest bucket, or a prefix plus bucket beyond the span a graph attends, eagerly (a policy, not a
        failure). max_start: the largest start. -> eos [B], bad [B]"""
        T = text.shape[1]
        key = bucket_for(T, self.prefill_lengths) if self.prefill_lengths else 0
        if key < T or max_start + key > self.prefill_span:
            inputs = self.staging.upload([slots, text, codec, start, length, allow_eos, floats, ints])
            return self.eager_prefill(*inputs, min(max_start + T, self.kv_max))
        if key > T:
            pad = (0, key - T)
            text = torch.nn.functional.pad(text, pad, value=self.text_pad)
            codec = torch.nn.functional.pad(codec, pad, value=NO_CODEC)
        return self.pf.run_split(self.prefill_buckets, key, {"slots": slots, "text": text, "codec": codec,
                                                            "start": start, "length": length,
                                                            "allow_eos": allow_eos, "floats": floats,
                                                            "ints": ints})

    def code_predictor(self, slots: Tensor, frame: Tensor) -> tuple[Tensor, ...]:
        return self.cp.run_split(self.buckets, None, {"slots": slots, "frame": frame})

    def talker(self, slots: Tensor, text: Tensor, frame: Tensor, allow_eos: Tensor, kv_len: int):
        key = bucket_for(kv_len, self.kv_buckets)
        return self.tk.run_split(self.buckets, key, {"slots": slots, "text": text, "frame": frame,
                                                     "allow_eos": allow_eos})

    def codec(self, slots: Tensor, first: Tensor, valid: Tensor, chunk: int) -> tuple[Tensor, ...]:
        """Frames [first, first + valid) of each row, valid [B] <= chunk -> the rows' audio (chunk frames each) and
        codes."""
        key = bucket_for(chunk, self.chunks)
        if key < chunk:
            raise ValueError(f"codec chunk of {chunk} frames is above the largest ramp size {key}")
        pcm, codes = self.cd.run_split(self.buckets, key, {"slots": slots, "first": first, "valid": valid})
        return pcm[:, : chunk * self.samples_per_frame], codes[:, :chunk]

    def capture_all(self, stages: Collection[str] = CAPTURED_STAGES) -> tuple[int, float]:
        """Capture every (bucket, key) of `stages` now, so no request ever waits for a capture (a tool that times
        some stages only captures theirs: a cold GPU compiles every kernel of every bucket it captures). Returns
        (graphs captured so far, seconds)."""
        unknown = set(stages) - set(CAPTURED_STAGES)
        if unknown:
            raise ValueError(f"capture_all: unknown stages {sorted(unknown)}; choose from {CAPTURED_STAGES}")
        t0 = time.monotonic()
        if "prefill" in stages:
            for b in self.prefill_buckets:
                for key in self.prefill_lengths:
                    self.pf._entry(b, key)
        for b in self.buckets:
            if "code_predictor" in stages:
                self.cp._entry(b, None)
            if "talker" in stages:
                for key in self.kv_buckets:
                    self.tk._entry(b, key)
            if "codec" in stages:
                for key in self.chunks:
                    self.cd._entry(b, key)
        if self.mode == "cuda":
            torch.cuda.synchronize()
        return self.pf.count + self.cp.count + self.tk.count + self.cd.count, time.monotonic() - t0
