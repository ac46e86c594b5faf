"""Measure the engine alone (no server): N concurrent streams, time to first audio and real-time factor.

    python -m engine.tools.bench_engine --model tiny-random|DIR|random:1.7b --streams 4 --frames 50 [--device cpu]

A stream keeps up with real time when it delivers audio at least as fast as it plays (RTF < 1); reported per
stream, with the slowest one deciding whether the run is real time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch

from engine.api import ContextSpec
from engine.config import EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.model.sampling_params import SamplingParams
from engine.model_source import load_model, resolve_dtype
from engine.types import AudioChunk, ContextDone


async def stream(engine: Engine, frames: int, seed: int) -> dict:
    t0 = time.monotonic()
    ctx = engine.open_context(ContextSpec(voice="ryan", language="english",
                                          sampling=SamplingParams(seed=seed, max_frames=frames, min_frames=frames)))
    ctx.append_text(list(range(1000, 1000 + 12)))
    ctx.close()
    first = None
    late_s = 0.0
    samples = 0
    async for ev in ctx.events():
        if isinstance(ev, AudioChunk):
            now = time.monotonic()
            first = first if first is not None else now
            due = first + samples / 24000  # when this chunk starts playing with no pre-buffer at 1x
            late_s += max(0.0, now - due)
            samples += len(ev.pcm)
        elif isinstance(ev, ContextDone) and ev.reason == "error":
            raise RuntimeError(f"stream {seed} failed: {ev.error_code}: {ev.error_message}")
    wall = time.monotonic() - t0
    return {"ttfa_ms": (first - t0) * 1e3, "audio_s": samples / 24000, "wall_s": wall,
            "rtf": wall / max(samples / 24000, 1e-9), "stall_ms": late_s * 1e3}


async def run(engine: Engine, streams: int, frames: int) -> list[dict]:
    return await asyncio.gather(*(stream(engine, frames, i) for i in range(streams)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random", help="as the server's --model: tiny-random, random:1.7b, "
                    "random:0.6b, random:tiny or a checkpoint directory")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--frames", type=int, default=50)
    ap.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    loaded = load_model(args.model, args.device, resolve_dtype(args.dtype, args.device))
    cfg = EngineConfig(scheduler=SchedulerConfig(max_slots=max(args.streams), admission_load=1e9,
                                                 max_waiting_first_audio=max(args.streams)),
                       max_frames=args.frames, max_prompt_tokens=64, cuda_graphs=args.cuda_graphs)
    engine = Engine(loaded, cfg)
    print(f"warm-up {engine.warmup():.1f} s; graphs: {engine.readiness().cuda_graphs.to_json()}")
    engine.start()
    results = {}
    try:
        for n in args.streams:
            rows = asyncio.run(run(engine, n, args.frames))
            worst = max(r["rtf"] for r in rows)
            results[n] = rows
            print(f"{n:3d} streams: TTFA p50 {sorted(r['ttfa_ms'] for r in rows)[n // 2]:7.1f} ms, "
                  f"RTF worst {worst:.3f} ({'real time' if worst < 1 else 'SLOWER than real time'}), "
                  f"late audio worst {max(r['stall_ms'] for r in rows):.0f} ms")
    finally:
        engine.stop()
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "device": args.device, "frames": args.frames,
                                               "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
