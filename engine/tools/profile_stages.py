"""Time each engine stage alone (prefill, Talker step, Code Predictor loop, codec chunk) per batch size, with and
without CUDA graphs, and break one call down by device kernel (or, on a CPU, by operator): name, count, total and
mean time, the 15 costliest names per stage, printed and saved in the JSON ("top_kernels").

    python -m engine.tools.profile_stages --model random:1.7b --device cuda --batches 1 8 32 \
        --prompt-lens 16 64 --cached-lens 1 4 16 --chunks 1 4 12 --out stages.json \
        [--codec-layouts contiguous channels_last]

A first_audio row is the chain of one step (Stage.FIRST_AUDIO: a dual-layout prefill after its cached prefix,
the Code Predictor for frame 0 and a 1-frame codec chunk), to set beside the sum of its three stages' rows.

A prefill row gives `prompt_len` (text tokens of a whole-layout prompt; with `cached_prefix`, the positions run
after it) and `positions` (what the prefill ran). --prompt-lens rows run with the prompt-prefix cache off (the
whole prompt); --cached-lens rows after their prefix was cached by the warm-up call (1: a dual-layout prompt, the
common case; n >= 3: a whole-layout prompt of n - 2 text tokens).

With several --codec-layouts, the codec stage is measured once per activation layout (its rows carry
"codec_layout"); the other stages do not depend on it and are measured with the first one only.

Each number is the median wall time of launch + collect (the runner's own entry points, so index uploads and
result copies count) over --repeat calls after one warm-up call; "span" (CUDA) is the median over 5 profiled calls
of the device's window from the call's first device op to its last. Under programmatic dependent launch the kernel
sum counts a kernel's wait as its time and the span does not, but the profiler adds a cost per kernel to it (H100,
5272deb: the Code Predictor at B1 spans 4.52 ms under the profiler, 3.68 ms of wall time without): compare spans
only between variants with the same kernels. This is where a step's milliseconds go; the
scheduler and the server are not involved. On CUDA every launch runs under torch's sync debug mode "error": a step
that makes the host wait for the device fails the tool.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable

import torch

from engine import kernels
from engine.config import EngineConfig, SchedulerConfig
from engine.graphs import CAPTURED_STAGES, GraphCaptureError
from engine.model.codec_layers import LAYOUTS
from engine.model.prompt import build_prompt, resolve_voice
from engine.model.sampling_params import SamplingParams
from engine.model_source import load_model as load
from engine.prefix_cache import PrefixLRU
from engine.runner import Runner
from engine.types import RowPlan, Stage, StagePlan


@contextlib.contextmanager
def _no_host_sync(device: torch.device):
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def kernel_breakdown(fn, device: torch.device, top: int = 15) -> dict:
    """Profile one call of fn: the device kernels it runs (CUDA, graph replays included) or, on a CPU, its
    top-level operators, grouped by name: {"count", "total_us", "top": [{name, count, total_us, mean_us}]},
    the `top` names with the most time first."""
    cuda = device.type == "cuda"
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        timed = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        timed = [(e.name, e.cpu_time_total) for e in prof.events()
                 if e.name.startswith("aten::") and e.cpu_parent is None]
    by_name: dict[str, list[float]] = {}
    for name, us in timed:
        by_name.setdefault(name, []).append(us)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"count": len(timed), "total_us": round(sum(us for _, us in timed), 1),
            "top": [{"name": name[:200], "count": len(us), "total_us": round(sum(us), 1),
                     "mean_us": round(sum(us) / len(us), 2)} for name, us in ranked]}


def span_us(ranges: list[tuple[float, float]]) -> float:
    """The device's window over (start, end) us ranges: first start to last end, overlaps and gaps included."""
    return max(end for _, end in ranges) - min(start for start, _ in ranges)


def device_span(fn, device: torch.device, calls: int = 5) -> float | None:
    """Median over `calls` profiled calls of fn of the window from its first device op's start to its last one's
    end (None on a CPU), profiler costs included (see the module's docstring)."""
    if device.type != "cuda":
        return None
    spans = []
    for _ in range(calls):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        ranges = [(e.time_range.start, e.time_range.end) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA]
        if ranges:
            spans.append(span_us(ranges))
    return round(statistics.median(spans), 1) if spans else None


def format_breakdown(title: str, breakdown: dict) -> str:
    lines = [f"{title}: {breakdown['count']} kernels, {breakdown['total_us']:.1f} us",
             f"  {'count':>6} {'total us':>10} {'mean us':>9}  name"]
    for k in breakdown["top"]:
        lines.append(f"  {k['count']:>6} {k['total_us']:>10.1f} {k['mean_us']:>9.2f}  {k['name'][:110]}")
    return "\n".join(lines)


def _time(fn, repeat: int) -> float:
    fn()  # warm-up: lazy init, capture of a graph not captured yet
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


class StageProfiler:
    def __init__(self, loaded, graphs: str, max_slots: int, prompt_cap: int,
                 stages: frozenset[str] = frozenset(CAPTURED_STAGES), capture: str = "all"):
        self.loaded = loaded
        cfg = EngineConfig(scheduler=SchedulerConfig(max_slots=max_slots), max_frames=256,
                           max_prompt_tokens=max(prompt_cap + 32, 256),  # the server's prefill graphs
                           cuda_graphs=graphs)
        self.runner = Runner(loaded, cfg)
        self.prefix_cache, self.no_prefix_cache = self.runner.prefix_cache, PrefixLRU(0, 0)
        self.graphs_captured = 0
        # capture "timed": no graph until a timed shape's warm-up call needs it (a compiled part compiles per
        # bucket, so capturing all of them would cost minutes of compiles that nothing times)
        if self.runner.graphs is not None and capture == "all":  # GraphCaptureError propagates
            self.graphs_captured = self.runner.graphs.capture_all(stages)[0]
        self.voice = resolve_voice(loaded.config, next(iter(loaded.config.talker.speaker_ids)), "auto")
        self.sampling = SamplingParams(seed=1, max_frames=256)
        self.check_syncs = False  # from the second call of a stage on (first calls may initialise lazily)

    def _run(self, stage: Stage, rows: list[RowPlan]) -> None:
        # On CUDA, any host synchronisation while launching a step raises (the runner promises none).
        with _no_host_sync(self.loaded.device if self.check_syncs else torch.device("cpu")):
            pending = self.runner.launch(StagePlan(stage, rows))
        result = self.runner.collect(pending)
        if any(result.failed):
            raise RuntimeError(f"{stage.value} step failed: {next(f for f in result.failed if f)}")

    def prefill_prompt(self, prompt_len: int, cached: bool):
        """The prompt of a prefill row: whole layout with prompt_len text tokens; cached, prompt_len positions
        after the prefix (1: the dual layout)."""
        if cached and prompt_len == 2:
            raise ValueError("--cached-lens 2: no prompt has 2 positions after its prefix; use 1 or >= 3")
        n = prompt_len - 2 if cached else prompt_len
        layout = "dual" if cached and prompt_len == 1 else "whole"
        return build_prompt(self.loaded.config, self.voice, list(range(1000, 1000 + max(n, 1))), layout, None)

    def prefill(self, batch: int, prompt_len: int, cached: bool = False) -> None:
        prompt = self.prefill_prompt(prompt_len, cached)
        self.runner.prefix_cache = self.prefix_cache if cached else self.no_prefix_cache
        rows = [RowPlan(i, i, i, 0, prompt=prompt, sampling=self.sampling, eos_allowed=False) for i in range(batch)]
        self._run(Stage.PREFILL, rows)

    def talker(self, batch: int) -> None:
        self._run(Stage.TALKER, [RowPlan(i, i, i, 1, text_id=1000, eos_allowed=False) for i in range(batch)])

    def code_predictor(self, batch: int) -> None:
        self._run(Stage.CODE_PREDICTOR, [RowPlan(i, i, i, 0) for i in range(batch)])

    def codec(self, batch: int, chunk: int) -> None:
        self._run(Stage.CODEC, [RowPlan(i, i, i, 0, chunk=chunk) for i in range(batch)])

    def first_audio(self, batch: int) -> None:
        """A newcomer's chain as one step: a dual-layout prompt after its cached prefix, frame 0, its audio."""
        prompt = self.prefill_prompt(1, cached=True)
        self.runner.prefix_cache = self.prefix_cache
        self._run(Stage.FIRST_AUDIO, [RowPlan(i, i, i, 0, prompt=prompt, sampling=self.sampling, eos_allowed=False,
                                              chunk=1) for i in range(batch)])


STAGES = frozenset({"prefill", "talker", "code_predictor", "codec", "first_audio"})


def profile(loaded, graphs: str, batches: list[int], prompt_lens: list[int], chunks: list[int],
            repeat: int, cached_lens: list[int] = (), stages: frozenset[str] = STAGES, capture: str = "all",
            on_row: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """Rows for each of `stages`, with the codec in loaded.codec's layout; on_row sees each row as it is measured."""
    # only the graphs of what is timed: the first-audio chain runs the prefill's, the Code Predictor's and the codec's
    captured = {"prefill", "code_predictor", "codec"} if "first_audio" in stages else set()
    p = StageProfiler(loaded, graphs, max(batches), max([*prompt_lens, *cached_lens]),
                      frozenset(captured | (stages & set(CAPTURED_STAGES))), capture)
    rows = []
    layout = loaded.codec.layout

    def measure(stage: str, batch: int, fn, **extra) -> None:
        p.check_syncs = False
        fn()
        p.check_syncs = True
        ms = _time(fn, repeat)
        breakdown = kernel_breakdown(fn, loaded.device)
        if stage == "codec":
            extra["codec_layout"] = layout
        rows.append({"stage": stage, "batch": batch, **extra, "graphs": graphs, "ms": round(ms, 3),
                     "kernels": breakdown["count"], "kernel_us": breakdown["total_us"],
                     "span_us": device_span(fn, loaded.device), "top_kernels": breakdown["top"]})
        on_row(rows[-1])

    for b in batches:
        if "prefill" in stages:
            for n in prompt_lens:
                measure("prefill", b, lambda b=b, n=n: p.prefill(b, n), prompt_len=n,
                        positions=len(p.prefill_prompt(n, False)))
            for n in cached_lens:  # measure's first call misses and keeps the prefix: the timed calls hit it
                prompt = p.prefill_prompt(n, True)
                measure("prefill", b, lambda b=b, n=n: p.prefill(b, n, cached=True), prompt_len=n,
                        positions=len(prompt) - prompt.prefix_len, cached_prefix=prompt.prefix_len)
        p.prefill(b, prompt_lens[0])  # fresh slots for the decode stages
        if "talker" in stages:
            measure("talker", b, lambda b=b: p.talker(b))
        if "code_predictor" in stages:
            measure("code_predictor", b, lambda b=b: p.code_predictor(b))
        if "codec" in stages:
            for c in chunks:
                measure("codec", b, lambda b=b, c=c: p.codec(b, c), chunk=c)
        if "first_audio" in stages:  # the prefill is one position after the prefix, as the engine runs it
            prompt = p.prefill_prompt(1, True)
            measure("first_audio", b, lambda b=b: p.first_audio(b), prompt_len=1,
                    positions=len(prompt) - prompt.prefix_len, cached_prefix=prompt.prefix_len)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[16])
    ap.add_argument("--cached-lens", type=int, nargs="*", default=[1],
                    help="prefill rows after a cached prompt prefix, by positions run (1: the dual layout)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 12])
    ap.add_argument("--graphs", nargs="+", default=None, help="on, off, emulate (default: on and off on CUDA)")
    ap.add_argument("--stages", nargs="+", choices=sorted(STAGES), default=sorted(STAGES))
    ap.add_argument("--codec-layouts", nargs="+", choices=LAYOUTS, default=None,
                    help="codec activation layouts to measure (default: the loaded codec's, VOICELANE_CODEC_LAYOUT)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--capture", choices=("all", "timed"), default="all",
                    help="graphs captured before timing: every bucket of the stages (as the server does), or only "
                         "the shapes timed, each on its warm-up call")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    loaded = load(a.model, a.device, dtype)
    modes = a.graphs or (["on", "off"] if device.type == "cuda" else ["off"])
    rows = []
    failures = {}
    layouts = a.codec_layouts or [loaded.codec.layout]

    def write(done: bool) -> None:  # after every row too, so a run stopped at its time limit keeps what it measured
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"model": a.model, "device": str(device), "dtype": str(dtype), "torch": torch.__version__,
                           "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "rows": rows,
                           "complete": done, "capture_failures": failures, "kernels": kernels.kernels_status()}, f,
                          indent=1)

    with torch.inference_mode():
        for mode in modes:
            for i, layout in enumerate(layouts):
                loaded.codec.set_layout(layout)
                loaded.codec.prepare_inference()
                try:
                    stages = frozenset(a.stages) if i == 0 else frozenset(a.stages) & {"codec"}
                    profile(loaded, mode, a.batches, a.prompt_lens, a.chunks, a.repeat,
                            a.cached_lens if i == 0 else [], stages, a.capture,
                            on_row=lambda row: (rows.append(row), write(False)))
                except GraphCaptureError as exc:
                    failures[f"{mode}/{layout}"] = str(exc)
                    print(f"graphs {mode}, codec layout {layout}: capture FAILED, not measured: {exc}")

    def extra(r: dict) -> str:  # prefill: text tokens, or "+n" positions after a cached prefix; codec: chunk
        if r.get("cached_prefix"):
            return f"+{r['prompt_len']}"
        return str(r.get("prompt_len", "")) if "chunk" not in r else f"{r['chunk']} {r['codec_layout'][:8]}"

    for r in rows:
        print(format_breakdown(f"\n{r['stage']} B{r['batch']} {extra(r)} graphs {r['graphs']}",
                               {"count": r["kernels"], "total_us": r["kernel_us"], "top": r["top_kernels"]}))
    print(f"\n{'stage':<15} {'batch':>5} {'extra':>10} {'graphs':>7} {'ms':>9} {'kernels':>8} {'kernel ms':>10} "
          f"{'span ms':>8}")
    for r in rows:
        span = "-" if r["span_us"] is None else f"{r['span_us'] / 1e3:.3f}"
        print(f"{r['stage']:<15} {r['batch']:>5} {extra(r):>10} {r['graphs']:>7} {r['ms']:>9.3f} {r['kernels']:>8} "
              f"{r['kernel_us'] / 1e3:>10.3f} {span:>8}")
    write(True)


if __name__ == "__main__":
    main()
