"""GPU check of the streaming codec (issue 12): correctness first, then timing, for every activation layout
(codec_layers.LAYOUTS: contiguous, channels_last) in one call. Run on a CUDA machine:

    python -m engine.tools.gpu_check_codec OUT_DIR [--layouts contiguous channels_last] [--batches 1 8 32 64]
        [--chunks 1 4 12] [--repeat 20]

A CPU smoke run (eager calls instead of graphs, fp32 only, the tiny codec) checks the tool itself:

    python -m engine.tools.gpu_check_codec OUT_DIR --device cpu --size tiny --batches 1 --chunks 1 --frames 8

Per layout, correctness (the exit status is 1 if any fails; timing still runs, so a failure shows its cost too):
- the Triton SnakeBeta against its PyTorch reference (fp32 relative error, bf16 within one ulp);
- streaming equals the whole-utterance decode on this GPU: fp32 (TF32 off) to 1e-4 over 340 frames in the
  scheduler's ramp 1, 2, 4, 8, 12, 12, ... (past 300 frames and several 72-frame windows); bf16 no less accurate
  against the fp32 decode than the bf16 whole decode is;
- a CUDA-graph replay of decode_stream equals the eager call (same inputs, copies of the same state).
Timing: decode_stream of the 1.7B codec (random weights, the random:1.7b seed), bf16, one CUDA graph per (batch,
chunk) as the engine captures them (cuDNN autotuning on), median of --repeat replays timed with CUDA events;
Triton on/off for the smallest and largest step; device kernels per step and the top 10 kernels by device time
from torch.profiler; FLOPs per step (torch's flop counter: convs, GEMMs, attention) and the floor they give at
the H200's measured bf16 peak. Writes OUT_DIR/gpu_check_codec.json ("layouts": one report per layout, "compare":
ms per (batch, chunk) side by side); prints the tables last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kernels import snake as sk
from engine.model.codec import CodecConfig, CodecDecoder, randomize_codec_
from engine.model.codec_layers import LAYOUTS
from engine.model.presets import codec_config

PEAK_BF16_TFLOPS = 789.0  # measured on the H200 (issue 12)
# Issue 12, commit 50861d6, this tool (graph replay, bf16, ms; docs/benchmarks/h200/codec_50861d6.json): "before".
BEFORE_MS = {(1, 1): 1.656, (8, 1): 2.248, (32, 1): 3.574, (64, 1): 5.219, (1, 4): 1.915, (8, 4): 2.953,
             (32, 4): 6.83, (64, 4): 11.797, (1, 12): 2.207, (8, 12): 5.039, (32, 12): 15.116, (64, 12): 28.126}
TARGET_MS = {(1, 1): 0.4, (64, 1): 3.5, (64, 12): 15.0}


@dataclass(frozen=True)
class Setup:
    """What a check runs on: the device, the codec size (its random weights) and the activation layout."""

    device: torch.device
    size: str
    layout: str

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def build_codec(setup: Setup, dtype: torch.dtype) -> CodecDecoder:
    """The codec of random:<size> (same seed as engine.model.random_model.build_random_model)."""
    dec = CodecDecoder(CodecConfig.from_dict(codec_config(setup.size)["decoder_config"]), layout=setup.layout)
    randomize_codec_(dec, seed=1)
    dec = dec.to(setup.device, dtype).eval()
    dec.prepare_inference()
    return dec


def ramp(total: int) -> list[int]:
    sizes = []
    steps = (1, 2, 4, 8)
    while sum(sizes) < total:
        sizes.append(steps[len(sizes)] if len(sizes) < len(steps) else 12)
    sizes[-1] -= sum(sizes) - total
    return sizes


def stream(dec: CodecDecoder, codes: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    state = dec.new_stream_state(codes.shape[0])
    slots = torch.arange(codes.shape[0], device=codes.device)
    out, t0 = [], 0
    for n in sizes:
        out.append(dec.decode_stream(codes[..., t0:t0 + n], state, slots))
        t0 += n
    return torch.cat(out, dim=-1)


def rms(x: torch.Tensor) -> float:
    return x.float().pow(2).mean().sqrt().item()


# ------------------------------------------------------------------------------------------ correctness


def check_snake(setup: Setup) -> dict:
    """SnakeBeta (the window kernel without a window) against the official ops, in the layout's strides, and the
    full window kernel (bias, residual, tails) against its PyTorch path."""
    gen = torch.Generator().manual_seed(0)
    dev, cl = setup.device, setup.layout == "channels_last"

    def act(B, C, T):
        t = torch.randn(B, T, C, generator=gen).transpose(1, 2) if cl else torch.randn(B, C, T, generator=gen)
        return (t * 3).to(dev)

    x = act(4, 96, 5000)
    freq = torch.exp(torch.randn(96, generator=gen) * 0.3).to(dev)
    inv = (1.0 / (torch.exp(torch.randn(96, generator=gen) * 0.3) + 1e-9)).to(dev)
    ref = sk.snake_reference(x, freq, inv)
    rel32 = ((sk.snake_triton(x, freq, inv) - ref).abs().max() / ref.abs().max()).item()
    x16, f16, i16 = x.bfloat16(), freq.bfloat16(), inv.bfloat16()
    ref16 = sk.snake_reference(x16.float(), f16.float(), i16.float())
    ulps = ((sk.snake_triton(x16, f16, i16).float() - ref16).abs() / (ref16.abs() * 2.0**-7 + 1e-30)).max().item()
    y, res, tail = act(2, 96, 300), act(2, 96, 300), act(2, 96, 54)
    bias = torch.randn(96, generator=gen).to(dev)
    outs = []
    for fn in (sk.conv_window_torch, sk.conv_window_triton):
        win, x_out, tail_out = act(2, 96, 354), act(2, 96, 300), act(2, 96, 54)
        fn(y, win, bias=bias, res=res, freq=freq, inv_mag=inv, x_out=x_out, tail_in=tail, tail_out=tail_out)
        outs.append((win, x_out, tail_out))
    window_err = max((a - b).abs().max().item() for a, b in zip(*outs, strict=True))
    return {"fp32_rel_err": rel32, "bf16_err_in_ulps": ulps, "window_fp32_max_abs_err": window_err,
            "ok": rel32 < 1e-5 and ulps <= 1.0 and window_err < 1e-4}


def check_streaming(setup: Setup, codes: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """codes [B, 16, N] on the device. Returns the checks and the fp32 whole decode (compared across layouts)."""
    sizes = ramp(codes.shape[-1])
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        d32 = build_codec(setup, torch.float32)
        truth = d32(codes)[:, 0]
        err32 = (stream(d32, codes, sizes) - truth).abs().max().item()
        del d32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False  # torch's default for matmul
        torch.backends.cudnn.allow_tf32 = True  # torch's default for cuDNN
    if not setup.cuda:  # bf16 convolutions on a CPU are far too slow for a smoke run
        return {"frames_fp32": codes.shape[-1], "chunks_fp32": sizes, "fp32_max_abs_err": err32,
                "fp32_ok": err32 < 1e-4, "ok": err32 < 1e-4}, truth
    d16 = build_codec(setup, torch.bfloat16)
    n16 = min(codes.shape[-1], 120)
    whole16 = d16(codes[..., :n16])[:, 0].float()
    stream16 = stream(d16, codes[..., :n16], ramp(n16)).float()
    ref = truth[:, : whole16.shape[-1]]
    e_whole, e_stream = rms(whole16 - ref), rms(stream16 - ref)
    ok32 = err32 < 1e-4
    ok16 = e_stream <= 1.5 * e_whole + 1e-4 and rms(stream16 - whole16) < 0.05 * rms(ref)
    return {"frames_fp32": codes.shape[-1], "chunks_fp32": sizes, "fp32_max_abs_err": err32, "fp32_ok": ok32,
            "frames_bf16": n16, "bf16_whole_rms_err_vs_fp32": e_whole, "bf16_stream_rms_err_vs_fp32": e_stream,
            "bf16_stream_vs_whole_max_abs": (stream16 - whole16).abs().max().item(), "signal_rms": rms(ref),
            "bf16_ok": ok16, "ok": ok32 and ok16}, truth


class StepGraph:
    """decode_stream of B rows x t frames captured as the engine does (warm-up on a side stream, then capture).
    On a CPU there is no graph: replay() is the eager call."""

    def __init__(self, dec: CodecDecoder, B: int, t: int, state=None):
        self.dec = dec
        self.state = dec.new_stream_state(B + 1) if state is None else state
        device = self.state.flat.device
        self.slots = torch.arange(B, device=device)
        self.codes = torch.randint(0, dec.config.codebook_size, (B, dec.config.num_quantizers, t), device=device)
        self.graph = None
        if device.type != "cuda":
            self.out = self.eager()
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.eager()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.eager()

    def eager(self) -> torch.Tensor:
        return self.dec.decode_stream(self.codes, self.state, self.slots)

    def replay(self) -> torch.Tensor:
        if self.graph is None:
            return self.eager()
        self.graph.replay()
        return self.out


def check_graph_equals_eager(dec: CodecDecoder) -> dict:
    g = StepGraph(dec, 4, 4)
    parts = (g.state.flat, g.state.pos, g.state.tail_at)
    start = [t.clone() for t in parts]
    graph_out = g.replay().clone()
    graph_state = [t.clone() for t in parts]
    for t, t0 in zip(parts, start, strict=True):
        t.copy_(t0)
    eager_out = g.eager()
    diff = (graph_out.float() - eager_out.float()).abs().max().item()
    state_diff = (graph_state[0].float() - g.state.flat.float()).abs().max().item()
    same_sides = torch.equal(graph_state[1], g.state.pos) and torch.equal(graph_state[2], g.state.tail_at)
    return {"max_abs_out_diff": diff, "max_abs_state_diff": state_diff, "positions_and_sides_equal": same_sides,
            "ok": diff <= 1e-3 and state_diff <= 1e-3 and same_sides}


# ---------------------------------------------------------------------------------------------- timing


def time_graph(g: StepGraph, repeat: int) -> float:
    for _ in range(3):
        g.replay()
    samples = []
    if g.graph is None:  # CPU: wall time of eager calls
        for _ in range(repeat):
            t0 = time.perf_counter()
            g.replay()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b))
    return statistics.median(samples)


def kernel_profile(g: StepGraph, calls: int = 3) -> dict:
    """Device kernels per replay and the top 10 by device time (from a profiled graph replay; if the profiler sees
    no kernels inside graphs, from the eager call, which runs the same kernels). On a CPU: top-level operators."""
    if g.graph is None:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                g.eager()
        source = "eager call, CPU operators"
        kernels = [(e.name, e.cpu_time_total) for e in prof.events() if e.cpu_parent is None]
    else:
        source = "graph replay"
    for fn in (g.replay, g.eager) if g.graph is not None else ():
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        kernels = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        if kernels:
            break
        source = "eager call (no kernels seen inside the graph replay)"
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, us in kernels:
        per_name[name][0] += 1
        per_name[name][1] += us
    top = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:10]
    total_us = sum(v[1] for v in per_name.values()) / calls
    return {"source": source, "kernels_per_step": len(kernels) / calls, "device_us_per_step": total_us,
            "top10": [{"kernel": name[:120], "calls_per_step": n / calls, "us_per_step": us / calls,
                       "share": us / calls / max(total_us, 1e-9)} for name, (n, us) in top]}


def step_flops(dec: CodecDecoder, B: int, t: int) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    state = dec.new_stream_state(B)
    device = state.flat.device
    codes = torch.zeros(B, dec.config.num_quantizers, t, dtype=torch.int64, device=device)
    with FlopCounterMode(display=False) as counter:
        dec.decode_stream(codes, state, torch.arange(B, device=device))
    return float(counter.get_total_flops())


def check_and_time(setup: Setup, a: argparse.Namespace, truths: dict[str, torch.Tensor]) -> dict:
    """Correctness checks, then timing, of one layout; truths: the fp32 whole decode of each layout checked so
    far (this one's is added, and compared with the first)."""
    report: dict = {"layout": setup.layout, "checks": {}, "timing": [], "triton_ab": [], "profiles": {}}
    dtype = torch.bfloat16 if setup.cuda else torch.float32
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 2048, (2, 16, a.frames), generator=gen).to(setup.device)
    if sk.use_triton(setup.device):
        report["checks"]["snake"] = check_snake(setup)
    report["checks"]["streaming"], truth = check_streaming(setup, codes)
    if truths:
        first, other = next(iter(truths.items()))
        diff = (truth - other).abs().max().item()
        report["checks"]["same_as_first_layout"] = {"layout": first, "fp32_whole_max_abs_diff": diff,
                                                    "ok": diff < 1e-4}
    truths[setup.layout] = truth
    dec = build_codec(setup, dtype)
    report["checks"]["graph_equals_eager"] = check_graph_equals_eager(dec)
    report["ok"] = all(c["ok"] for c in report["checks"].values())
    print(setup.layout, json.dumps(report["checks"], indent=1))

    largest = (max(a.batches), max(a.chunks))
    smallest = (min(a.batches), min(a.chunks))
    for t in a.chunks:
        for B in a.batches:
            g = StepGraph(dec, B, t)
            ms = time_graph(g, a.repeat)
            prof = kernel_profile(g)
            flops = step_flops(dec, B, t)
            h200 = setup.cuda and setup.size != "tiny"  # what the before and target columns were measured on
            row = {"layout": setup.layout, "batch": B, "chunk": t, "ms": ms,
                   "before_ms": BEFORE_MS.get((B, t)) if h200 else None,
                   "target_ms": TARGET_MS.get((B, t)) if h200 else None, "kernels": prof["kernels_per_step"],
                   "gflop": flops / 1e9, "floor_ms": flops / (PEAK_BF16_TFLOPS * 1e12) * 1e3,
                   "tflops": flops / (ms * 1e-3) / 1e12, "us_per_frame_row": ms * 1e3 / (B * t)}
            report["timing"].append(row)
            if (B, t) in (smallest, largest):
                report["profiles"][f"B{B}xT{t}"] = prof
                if sk.use_triton(setup.device):
                    sk.set_triton_enabled(False)
                    try:
                        ms_off = time_graph(StepGraph(dec, B, t), a.repeat)
                    finally:
                        sk.set_triton_enabled(True)
                    report["triton_ab"].append({"batch": B, "chunk": t, "triton_ms": ms, "torch_snake_ms": ms_off})
            del g
            if setup.cuda:
                torch.cuda.empty_cache()
    return report


def print_report(report: dict) -> None:
    for name, prof in report["profiles"].items():
        print(f"\n{report['layout']}: top kernels {name} ({prof['source']}): {prof['kernels_per_step']:.0f} kernels, "
              f"{prof['device_us_per_step']:.0f} us device time per step")
        for k in prof["top10"]:
            share = k["share"] * 100
            print(f"  {k['us_per_step']:9.1f} us {share:5.1f}% x{k['calls_per_step']:<5.0f} {k['kernel'][:90]}")
    for ab in report["triton_ab"]:
        print(f"{report['layout']}: Triton kernels B{ab['batch']} x {ab['chunk']}: {ab['triton_ms']:.3f} ms, "
              f"PyTorch path {ab['torch_snake_ms']:.3f} ms")
    print(f"\n{report['layout']}: correctness {'OK' if report['ok'] else 'FAILED'}")
    print(f"{'chunk':>5} {'batch':>5} {'ms':>8} {'before':>7} {'target':>7} {'kernels':>8} {'GFLOP':>8} "
          f"{'floor ms':>9} {'TFLOP/s':>8} {'us/frame-row':>12}")
    for r in report["timing"]:
        before = f"{r['before_ms']:.2f}" if r["before_ms"] else "-"
        target = f"{r['target_ms']:.1f}" if r["target_ms"] else "-"
        print(f"{r['chunk']:>5} {r['batch']:>5} {r['ms']:>8.3f} {before:>7} {target:>7} {r['kernels']:>8.0f} "
              f"{r['gflop']:>8.1f} {r['floor_ms']:>9.3f} {r['tflops']:>8.1f} {r['us_per_frame_row']:>12.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    ap.add_argument("--device", default="cuda", help="cuda (the check), or cpu for a smoke run of the tool")
    ap.add_argument("--size", default="1.7b", choices=["tiny", "0.6b", "1.7b"], help="whose codec (random weights)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 12])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--frames", type=int, default=340, help="frames of the fp32 streaming-equals-whole check")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check_codec needs a CUDA device (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # as the engine sets it before capturing graphs
    report: dict = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                    "device": str(device), "size": a.size, "torch": torch.__version__,
                    "triton_snake": sk.kernels_status(), "layouts": {}}
    truths: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for layout in a.layouts:
            report["layouts"][layout] = check_and_time(Setup(device, a.size, layout), a, truths)
    report["ok"] = all(r["ok"] for r in report["layouts"].values())
    report["compare"] = [{"batch": rows[0]["batch"], "chunk": rows[0]["chunk"],
                          **{r["layout"]: r["ms"] for r in rows}, "before_ms": rows[0]["before_ms"]}
                         for rows in zip(*(r["timing"] for r in report["layouts"].values()), strict=True)]
    report["runtime_s"] = time.monotonic() - t_start
    (out_dir / "gpu_check_codec.json").write_text(json.dumps(report, indent=1))

    for r in report["layouts"].values():
        print_report(r)
    print(f"\n{'chunk':>5} {'batch':>5} " + " ".join(f"{name:>14}" for name in a.layouts) + f" {'before':>8}")
    for c in report["compare"]:
        before = f"{c['before_ms']:.2f}" if c["before_ms"] else "-"
        print(f"{c['chunk']:>5} {c['batch']:>5} " + " ".join(f"{c[name]:>14.3f}" for name in a.layouts)
              + f" {before:>8}")
    print(f"\ncorrectness: {'OK' if report['ok'] else 'FAILED'}; runtime {report['runtime_s']:.0f} s; snake: "
          f"{report['triton_snake']}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
