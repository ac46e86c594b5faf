"""Time the codec's window kernel (engine/kernels/snake.py) per launch config on the calls a real codec step makes.

    python -m engine.tools.tune_conv_window OUT_DIR [--batch 64] [--frames 12] [--layout channels_last]

One eager decode_stream of the random 1.7B codec (bf16) records every conv_window call it makes, with its tensors.
Then each call is launched with every candidate config (WindowConfig: tile, warps, libdevice's sine or the
polynomial one) and timed with CUDA events (median of --repeat launches after a warm-up); its outputs are compared
with the default config's: a tile or warp change must write identical bits, the polynomial sine at most one step
of bf16 from libdevice's (a few steps in fp32, the --smoke run's dtype). Writes OUT_DIR/conv_window_tune.json
(every call, every config) and prints, per config, the summed time over the step's calls against the default and
against the bandwidth floor (the bytes each call must move at --bandwidth GB/s).

--smoke (tests): the tiny codec on the CPU through Triton's interpreter, two configs, no timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from engine import kernels
from engine.kernels import snake as sk


def candidates(smoke: bool) -> list[sk.WindowConfig | None]:
    """None is the engine's own choice (window_config); each entry else replaces it for every call."""
    if smoke:
        return [None, sk.WindowConfig(8, 16, fast_sin=True)]
    out: list[sk.WindowConfig | None] = [None]
    for block_t, warps in ((16, 4), (32, 4), (32, 8), (64, 8)):
        out.append(sk.WindowConfig(128, block_t, warps, fast_sin=True))
    out.append(sk.WindowConfig(128, 32, 4, fast_sin=False))
    return out


def resolve(cfg: sk.WindowConfig | None, call: dict) -> sk.WindowConfig:
    """A candidate fitted to a call: the default's tile where the candidate's does not apply (a contiguous
    layout, or one channel), the candidate's warps and sine kept."""
    y, win = call["y"], call["win"]
    default = sk.window_config(y.shape[1], win.shape[2], win.stride(1) == 1, win.dtype)
    if cfg is None:
        return default
    if win.stride(1) != 1 or y.shape[1] == 1:
        return sk.WindowConfig(default.block_c, default.block_t, cfg.num_warps, cfg.fast_sin)
    return cfg


def record(batch: int, frames: int, layout: str, device: torch.device, size: str) -> list[dict]:
    """Every conv_window call of one streaming codec step, its arguments kept (tensors alive)."""
    from engine.tools.gpu_check_codec import Setup, build_codec

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the engine's; fp32 shows the sines apart
    dec = build_codec(Setup(device, size, layout), dtype)
    calls: list[dict] = []
    real = sk.conv_window_triton

    def keep(y, win, **kw):  # the codec's layers call the module's function by name: this one, for one step
        calls.append({"y": y, "win": win, **kw})
        return real(y, win, **kw)

    state = dec.new_stream_state(batch)
    codes = torch.randint(0, dec.config.codebook_size, (batch, dec.config.num_quantizers, frames), device=device)
    sk.conv_window_triton = keep
    try:
        with torch.no_grad(), kernels.backend("triton"):
            dec.decode_stream(codes, state, torch.arange(batch, device=device))
    finally:
        sk.conv_window_triton = real
    return calls


def outputs(call: dict) -> list[torch.Tensor]:
    return [t for t in (call["win"], call.get("x_out"), call.get("tail_out")) if t is not None]


def launch(call: dict, cfg: sk.WindowConfig) -> None:
    args = {k: v for k, v in call.items() if k not in ("y", "win")}
    sk.conv_window_triton(call["y"], call["win"], config=cfg, **args)


def call_bytes(call: dict) -> int:
    """What a call must read and write at least: inputs once, outputs once."""
    y, win = call["y"], call["win"]
    n = y.numel() * y.element_size()
    read = n * (1 + (call.get("res") is not None)) + sum(
        call[k].numel() * call[k].element_size() for k in ("tail_in",) if call.get(k) is not None)
    written = win.numel() * win.element_size() + sum(
        call[k].numel() * call[k].element_size() for k in ("x_out", "tail_out") if call.get(k) is not None)
    return read + written


def time_call(call: dict, cfg: sk.WindowConfig, repeat: int) -> float:
    """Median microseconds of one launch."""
    for _ in range(3):
        launch(call, cfg)
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch(call, cfg)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def compare(call: dict, cfg: sk.WindowConfig, truth: list[torch.Tensor]) -> dict:
    """The call's outputs under cfg against the default's: identical, or how far (in the dtype's steps)."""
    launch(call, cfg)
    got = outputs(call)
    equal = all(torch.equal(a, b) for a, b in zip(got, truth, strict=True))
    step = torch.finfo(truth[0].dtype).eps
    far = max(((a.float() - b.float()).abs() / b.float().abs().clamp(min=1.0)).max().item() / step
              for a, b in zip(got, truth, strict=True))
    share = max((a != b).float().mean().item() for a, b in zip(got, truth, strict=True))
    return {"identical": equal, "max_steps": far, "share_different": share}


def sine_steps(win: torch.Tensor) -> float:
    """How far (in the dtype's relative steps) the polynomial sine may put an output from libdevice's: one bf16
    step (both round once), or the polynomial's 3.4e-7 in fp32 (about 3 steps)."""
    return 1.0 if win.dtype != torch.float32 else 8.0


def run(a: argparse.Namespace) -> dict:
    device = torch.device("cpu" if a.smoke else "cuda")
    calls = record(a.batch, a.frames, a.layout, device, "tiny" if a.smoke else a.size)
    configs = candidates(a.smoke)
    rows = []
    totals = {i: 0.0 for i in range(len(configs))}
    ok = {i: True for i in range(len(configs))}
    floor_us = 0.0
    for n, call in enumerate(calls):
        y, win = call["y"], call["win"]
        floor = call_bytes(call) / (a.bandwidth * 1e3)
        floor_us += floor
        default = resolve(None, call)
        launch(call, default)
        truth = [t.clone() for t in outputs(call)]
        row = {"call": n, "shape": list(y.shape), "window": win.shape[2], "dtype": str(win.dtype),
               "snake": call.get("freq") is not None, "res": call.get("res") is not None,
               "floor_us": floor, "configs": []}
        for i, cfg in enumerate(configs):
            used = resolve(cfg, call)
            entry = {"candidate": i, "config": asdict(used)}
            entry.update(compare(call, used, truth))
            exact = entry["identical"] or (used.fast_sin != default.fast_sin and entry["max_steps"] <= sine_steps(win))
            entry["ok"] = exact
            ok[i] &= exact
            if not a.smoke:
                entry["us"] = time_call(call, used, a.repeat)
                totals[i] += entry["us"]
            row["configs"].append(entry)
        rows.append(row)
    summary = [{"candidate": i, "config": None if cfg is None else asdict(cfg), "ok": ok[i],
                "total_us": totals[i] if not a.smoke else None} for i, cfg in enumerate(configs)]
    return {"batch": a.batch, "frames": a.frames, "layout": a.layout, "size": a.size,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "calls": len(calls), "floor_us": floor_us, "bandwidth_gbs": a.bandwidth, "summary": summary,
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--frames", type=int, default=12)
    ap.add_argument("--layout", default="channels_last", choices=["contiguous", "channels_last"])
    ap.add_argument("--size", default="1.7b", choices=["tiny", "0.6b", "1.7b"])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--bandwidth", type=float, default=4800.0, help="GB/s for the floor (H200 HBM3e: 4800)")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if not a.smoke and not torch.cuda.is_available():
        print("tune_conv_window: needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    report = run(a)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "conv_window_tune.json").write_text(json.dumps(report, indent=1))
    base = report["summary"][0]["total_us"]
    print(f"{report['calls']} window calls of a {a.batch} x {a.frames} frame step ({a.layout}); floor "
          f"{report['floor_us']:.0f} us at {a.bandwidth:g} GB/s")
    for s in report["summary"]:
        t = s["total_us"]
        timing = "" if t is None else f"{t:8.0f} us ({t / base:5.2f} x default)"
        print(f"  {s['candidate']}: {s['config'] or 'default'} ok={s['ok']} {timing}")
    return 0 if all(s["ok"] for s in report["summary"]) else 1


if __name__ == "__main__":
    sys.exit(main())
