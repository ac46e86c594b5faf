"""GPU check of the streaming codec (issue 12): correctness first, then timing. Run on a CUDA machine:

    python -m engine.tools.gpu_check_codec OUT_DIR [--batches 1 8 32 64] [--chunks 1 4 12] [--repeat 20]

Correctness (the exit status is 1 if any fails; timing still runs, so a failure shows its cost too):
- the Triton SnakeBeta against its PyTorch reference (fp32 relative error, bf16 within one ulp);
- streaming equals the whole-utterance decode on this GPU: fp32 (TF32 off) to 1e-4 over 340 frames in the
  scheduler's ramp 1, 2, 4, 8, 12, 12, ... (past 300 frames and several 72-frame windows); bf16 no less accurate
  against the fp32 decode than the bf16 whole decode is;
- a CUDA-graph replay of decode_stream equals the eager call (same inputs, copies of the same state).
Timing: decode_stream of the 1.7B codec (random weights, the random:1.7b seed), bf16, one CUDA graph per (batch,
chunk) as the engine captures them (cuDNN autotuning on), median of --repeat replays timed with CUDA events;
Triton on/off for the smallest and largest step; device kernels per step and the top 10 kernels by device time
from torch.profiler; FLOPs per step (torch's flop counter: convs, GEMMs, attention) and the floor they give at
the H200's measured bf16 peak. Writes OUT_DIR/gpu_check_codec.json; prints the table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from engine.kernels import snake as sk
from engine.model.codec import CodecConfig, CodecDecoder, randomize_codec_
from engine.model.presets import codec_config

PEAK_BF16_TFLOPS = 789.0  # measured on the H200 (issue 12)
# Issue 12, commit ac97106, profile_stages --graphs on, bf16 (ms): the "before" column.
BEFORE_MS = {(1, 1): 3.3, (8, 1): 4.6, (32, 1): 7.7, (64, 1): 11.9, (1, 4): 3.7, (8, 4): 7.9, (32, 4): 14.5,
             (64, 4): 22.6, (1, 12): 4.3, (8, 12): 12.0, (32, 12): 31.1, (64, 12): 55.6}
TARGET_MS = {(1, 1): 0.4, (64, 1): 3.5, (64, 12): 15.0}


def build_codec(dtype: torch.dtype) -> CodecDecoder:
    """The codec of random:1.7b (same seed as engine.model.random_model.build_random_model), on the GPU."""
    dec = CodecDecoder(CodecConfig.from_dict(codec_config("1.7b")["decoder_config"]))
    randomize_codec_(dec, seed=1)
    dec = dec.to("cuda", dtype).eval()
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
    slots = torch.arange(codes.shape[0], device="cuda")
    out, t0 = [], 0
    for n in sizes:
        out.append(dec.decode_stream(codes[..., t0:t0 + n], state, slots))
        t0 += n
    return torch.cat(out, dim=-1)


def rms(x: torch.Tensor) -> float:
    return x.float().pow(2).mean().sqrt().item()


# ------------------------------------------------------------------------------------------ correctness


def check_snake() -> dict:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 96, 5000, generator=gen) * 3).cuda()
    freq = torch.exp(torch.randn(96, generator=gen) * 0.3).cuda()
    inv = (1.0 / (torch.exp(torch.randn(96, generator=gen) * 0.3) + 1e-9)).cuda()
    ref = sk.snake_reference(x, freq, inv)
    rel32 = ((sk.snake_triton(x, freq, inv) - ref).abs().max() / ref.abs().max()).item()
    x16, f16, i16 = x.bfloat16(), freq.bfloat16(), inv.bfloat16()
    ref16 = sk.snake_reference(x16.float(), f16.float(), i16.float())
    ulps = ((sk.snake_triton(x16, f16, i16).float() - ref16).abs() / (ref16.abs() * 2.0**-7 + 1e-30)).max().item()
    return {"fp32_rel_err": rel32, "bf16_err_in_ulps": ulps, "ok": rel32 < 1e-5 and ulps <= 1.0}


def check_streaming(codes: torch.Tensor) -> dict:
    """codes [B, 16, N] on the GPU."""
    sizes = ramp(codes.shape[-1])
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        d32 = build_codec(torch.float32)
        truth = d32(codes)[:, 0]
        err32 = (stream(d32, codes, sizes) - truth).abs().max().item()
        del d32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False  # torch's default for matmul
        torch.backends.cudnn.allow_tf32 = True  # torch's default for cuDNN
    d16 = build_codec(torch.bfloat16)
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
            "bf16_ok": ok16, "ok": ok32 and ok16}


class StepGraph:
    """decode_stream of B rows x t frames captured as the engine does (warm-up on a side stream, then capture)."""

    def __init__(self, dec: CodecDecoder, B: int, t: int, state=None):
        self.dec = dec
        self.state = dec.new_stream_state(B + 1) if state is None else state
        self.slots = torch.arange(B, device="cuda")
        self.codes = torch.randint(0, dec.config.codebook_size, (B, dec.config.num_quantizers, t), device="cuda")
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
        self.graph.replay()
        return self.out


def check_graph_equals_eager(dec: CodecDecoder) -> dict:
    g = StepGraph(dec, 4, 4)
    start = g.state.flat.clone(), g.state.pos.clone()
    graph_out = g.replay().clone()
    graph_state = g.state.flat.clone()
    g.state.flat.copy_(start[0])
    g.state.pos.copy_(start[1])
    eager_out = g.eager()
    diff = (graph_out.float() - eager_out.float()).abs().max().item()
    state_diff = (graph_state.float() - g.state.flat.float()).abs().max().item()
    return {"max_abs_out_diff": diff, "max_abs_state_diff": state_diff, "ok": diff <= 1e-3 and state_diff <= 1e-3}


# ---------------------------------------------------------------------------------------------- timing


def time_graph(g: StepGraph, repeat: int) -> float:
    for _ in range(3):
        g.replay()
    samples = []
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
    no kernels inside graphs, from the eager call, which runs the same kernels)."""
    source = "graph replay"
    for fn in (g.replay, g.eager):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        if kernels:
            break
        source = "eager call (no kernels seen inside the graph replay)"
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        per_name[e.name][0] += 1
        per_name[e.name][1] += e.time_range.elapsed_us()
    top = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:10]
    total_us = sum(v[1] for v in per_name.values()) / calls
    return {"source": source, "kernels_per_step": len(kernels) / calls, "device_us_per_step": total_us,
            "top10": [{"kernel": name[:120], "calls_per_step": n / calls, "us_per_step": us / calls,
                       "share": us / calls / max(total_us, 1e-9)} for name, (n, us) in top]}


def step_flops(dec: CodecDecoder, B: int, t: int) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    state = dec.new_stream_state(B)
    codes = torch.zeros(B, dec.config.num_quantizers, t, dtype=torch.int64, device="cuda")
    with FlopCounterMode(display=False) as counter:
        dec.decode_stream(codes, state, torch.arange(B, device="cuda"))
    return float(counter.get_total_flops())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 12])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--frames", type=int, default=340, help="frames of the fp32 streaming-equals-whole check")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check_codec needs a CUDA device", file=sys.stderr)
        return 2
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    torch.backends.cudnn.benchmark = True  # as the engine sets it before capturing graphs
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "triton_snake": sk.kernels_status(), "checks": {}, "timing": [], "triton_ab": [], "profiles": {}}
    with torch.inference_mode():
        gen = torch.Generator().manual_seed(7)
        codes = torch.randint(0, 2048, (2, 16, a.frames), generator=gen).cuda()
        report["checks"]["snake"] = check_snake()
        report["checks"]["streaming"] = check_streaming(codes)
        dec = build_codec(torch.bfloat16)
        report["checks"]["graph_equals_eager"] = check_graph_equals_eager(dec)
        ok = all(c["ok"] for c in report["checks"].values())
        print(json.dumps(report["checks"], indent=1))

        largest = (max(a.batches), max(a.chunks))
        smallest = (min(a.batches), min(a.chunks))
        for t in a.chunks:
            for B in a.batches:
                g = StepGraph(dec, B, t)
                ms = time_graph(g, a.repeat)
                prof = kernel_profile(g)
                flops = step_flops(dec, B, t)
                row = {"batch": B, "chunk": t, "ms": ms, "before_ms": BEFORE_MS.get((B, t)),
                       "target_ms": TARGET_MS.get((B, t)), "kernels": prof["kernels_per_step"],
                       "gflop": flops / 1e9, "floor_ms": flops / (PEAK_BF16_TFLOPS * 1e12) * 1e3,
                       "tflops": flops / (ms * 1e-3) / 1e12, "us_per_frame_row": ms * 1e3 / (B * t)}
                report["timing"].append(row)
                if (B, t) in (smallest, largest):
                    report["profiles"][f"B{B}xT{t}"] = prof
                    sk.set_triton_enabled(False)
                    try:
                        ms_off = time_graph(StepGraph(dec, B, t), a.repeat)
                    finally:
                        sk.set_triton_enabled(True)
                    report["triton_ab"].append({"batch": B, "chunk": t, "triton_ms": ms, "torch_snake_ms": ms_off})
                del g
                torch.cuda.empty_cache()
    report["ok"] = ok
    report["runtime_s"] = time.monotonic() - t_start
    (out_dir / "gpu_check_codec.json").write_text(json.dumps(report, indent=1))

    for name, prof in report["profiles"].items():
        print(f"\ntop kernels {name} ({prof['source']}): {prof['kernels_per_step']:.0f} kernels, "
              f"{prof['device_us_per_step']:.0f} us device time per step")
        for k in prof["top10"]:
            share = k["share"] * 100
            print(f"  {k['us_per_step']:9.1f} us {share:5.1f}% x{k['calls_per_step']:<5.0f} {k['kernel'][:90]}")
    for ab in report["triton_ab"]:
        print(f"Triton SnakeBeta B{ab['batch']} x {ab['chunk']}: {ab['triton_ms']:.3f} ms, "
              f"PyTorch SnakeBeta {ab['torch_snake_ms']:.3f} ms")
    print(f"\ncorrectness: {'OK' if ok else 'FAILED'}; runtime {report['runtime_s']:.0f} s; snake: "
          f"{report['triton_snake']}")
    print(f"{'chunk':>5} {'batch':>5} {'ms':>8} {'before':>7} {'target':>7} {'kernels':>8} {'GFLOP':>8} "
          f"{'floor ms':>9} {'TFLOP/s':>8} {'us/frame-row':>12}")
    for r in report["timing"]:
        before = f"{r['before_ms']:.1f}" if r["before_ms"] else "-"
        target = f"{r['target_ms']:.1f}" if r["target_ms"] else "-"
        print(f"{r['chunk']:>5} {r['batch']:>5} {r['ms']:>8.3f} {before:>7} {target:>7} {r['kernels']:>8.0f} "
              f"{r['gflop']:>8.1f} {r['floor_ms']:>9.3f} {r['tflops']:>8.1f} {r['us_per_frame_row']:>12.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
