"""Where a persistent Code Predictor forward (engine.kernels.cp_forward) spends its time, on the GPU.

    python -m engine.tools.probe_cp_forward OUT_DIR [--model random:1.7b] [--batches 1 64]
        [--shapes default warps=8 k=256/stages=4]

Every time is the median of triton.testing.do_bench_cudagraph's repetitions of a CUDA graph of the launch (and, for a
persistent launch, the memset of its barrier counters), so host launch cost is not in it. For each batch (T = 1, a
later forward, the cache filled to position 15):
1. the whole forward in each launch shape (`--shapes`, VOICELANE_CP_FORWARD_TILES syntax; `default` is Tiles());
2. in the first shape, the persistent forward cut after step k, for every k: the rise from k - 1 to k is step k - 1's
   cost plus one grid barrier;
3. each step alone as a phased launch (its cost with no barrier, plus one launch in a graph);
4. a launch of 25 grid barriers and nothing else, on the same grid;
5. the stack's weight bytes over the whole forward's time: the bandwidth it reached (the H200's is about 4.8 TB/s);
6. for batches of at most engine.kernels.cp_stream.STREAM_ROWS rows, the streamed forward (VOICELANE_CP_FORWARD=
   streamed; its barriers' polls relaxed, then every poll an acquire; 16 warps; without its L2 hints; every layer
   on layer 0's weights, which stay in L2) and the layer-by-layer path (the model's own, with this process's kernel
   switches), whole forwards;
7. with --stamps N, the streamed forward's timeline over N launches (timeline(): per step kind, how long a program
   works between its barriers, how long it waits at them, how far apart the programs arrive, and how long the last
   arrival takes to release the first waiter).
--stream-only skips 1 to 4.
Writes OUT_DIR/probe_cp_forward.json and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import triton
import triton.language as tl

from engine.kernels.cp_forward import _grid_barrier
from engine.kernels.cp_stream import STREAM_ROWS, WARPS_ENV, stamp_marks, stream_forward

PHASE_NAMES = ("qkv", "attn", "o", "up", "down")


@triton.jit
def _barriers_only(bar_ptr, n, target, SPIN_LIMIT: tl.constexpr):
    i = 0
    while i < n:
        _grid_barrier(bar_ptr + i, target, bar_ptr + n, SPIN_LIMIT)
        i += 1


def _inputs(cp, batch: int, device: str):
    from engine.model.layers import rope_cos_sin, signed_sin

    cfg = cp.model.cfg
    dtype = next(cp.parameters()).dtype
    g = torch.Generator(device=device).manual_seed(batch)
    x = torch.randn(batch, 1, cfg.hidden_size, device=device, generator=g).to(dtype)
    positions = torch.full((batch, 1), 15, device=device, dtype=torch.int64)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)
    k = torch.randn(cfg.num_layers, batch + 1, cfg.num_kv_heads, cp.positions, cfg.head_dim, device=device,
                    generator=g).to(dtype)
    v = torch.randn(k.shape, device=device, generator=g).to(dtype)
    slots = torch.arange(batch, 0, -1, device=device)
    return (cp.model, x, cos, signed_sin(sin), k, v, slots, positions, cp.model.norm.weight, cp.lm_head[2].weight)


def _bench_ms(fn) -> float:
    fn()  # compile and warm outside the graph
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))


def timeline(stamps: np.ndarray, layers: int) -> dict:
    """The streamed forward's stamps (int64 [launches, programs, stamp_marks(layers), 2]: global timer ns, clock
    cycles; cp_stream._stamp) as times in us, medians over launches and layers, per step kind:
    - work: a program's time from passing a barrier to its arrival at the next (clock cycles, at the rate its own
      clock ran against the timer over the forward), median over programs, and the slowest program's;
    - wait: from its arrival to passing the barrier, median over programs;
    - spread: last arrival minus first, by the timer;
    - release: first program past the barrier minus the last arrival, by the timer (it has the timer's resolution,
      `timer_step_us`: the smallest gap between two timer values of a launch).
    `forward_us`: each program's first to last stamp, median."""
    n_steps = 5 * layers + 1
    timer = stamps[..., 0].astype(np.float64) / 1e3
    clock = stamps[..., 1].astype(np.float64)
    rate = (timer[..., -1] - timer[..., 0]) / np.maximum(clock[..., -1] - clock[..., 0], 1)  # us a cycle
    cycles = np.diff(clock, axis=-1) * rate[..., None]  # [launches, programs, marks - 1] us
    work = cycles[..., 0::2]  # [launches, programs, steps]
    wait = cycles[..., 1::2]  # [launches, programs, steps - 1]
    starts, ends = timer[..., 0::2], timer[..., 1::2]
    spread = ends.max(axis=1) - ends.min(axis=1)  # [launches, steps]
    release = starts[:, :, 1:].min(axis=1) - ends[:, :, :-1].max(axis=1)  # [launches, steps - 1]
    gaps = np.concatenate([np.diff(np.unique(stamps[i, :, :, 0])) for i in range(stamps.shape[0])]) / 1e3
    kinds: dict[str, dict[str, float]] = {}
    for k, name in enumerate((*PHASE_NAMES, "head")):
        at = [n_steps - 1] if name == "head" else [5 * layer + k for layer in range(layers)]
        waits = [s for s in at if s < n_steps - 1]
        kinds[name] = {
            "work_us": float(np.median(work[:, :, at])),
            "work_slowest_us": float(np.median(work[:, :, at].max(axis=1))),
            "spread_us": float(np.median(spread[:, at])),
            "wait_us": float(np.median(wait[:, :, waits])) if waits else 0.0,
            "release_us": float(np.median(release[:, waits])) if waits else 0.0,
        }
    return {"launches": int(stamps.shape[0]), "forward_us": float(np.median(timer[..., -1] - timer[..., 0])),
            "timer_step_us": float(gaps.min()) if gaps.size else 0.0, "kinds": kinds}


def probe(loaded, batches: list[int], shapes: list[str], device: str = "cuda", bench=None,
          per_step: bool = True, persistent: bool = True, stamps: int = 0) -> dict:
    """The tables' numbers (per_step False: the launch shapes only; persistent False: the streamed forward and the
    layer path only; stamps: launches of the streamed forward's timeline, GPU only). device "cpu" and a `bench`
    that runs fn once (tests: the tool's logic through triton's interpreter, one program). A shape that fails to
    compile or run (too much shared memory for its tiles, say) is recorded with its error and the others go on."""
    from engine.kernels import cp_forward as cf

    bench = bench or _bench_ms

    cp = loaded.tts.talker.code_predictor
    cfg = cp.model.cfg
    L = cfg.num_layers
    n_steps = cf.steps(L)
    weights = cf.stacked_layers(cp.model)
    weight_bytes = sum(t.numel() * t.element_size() for t in (weights.qkv, weights.o, weights.gate_up, weights.down,
                                                              cp.lm_head[2].weight))
    programs = cf._multiprocessors(torch.device(device)) if device == "cuda" else 1
    record = {"gpu": torch.cuda.get_device_name() if device == "cuda" else device, "programs": programs,
              "weight_bytes": weight_bytes, "batches": {}}
    counters = cf.barrier_counters(1, L, device)[0]
    for batch in batches:
        args = _inputs(cp, batch, device)
        row: dict = {"shapes": {}, "prefix_ms": [], "phased_step_ms": []}

        def run(mode, tiles, step_range=None, args=args):
            if mode == "persistent":
                counters.zero_()
            with torch.inference_mode():
                cf.cp_forward(*args, mode, counters if mode == "persistent" else None, programs=programs,
                              tiles=tiles, step_range=step_range)

        for shape in shapes if persistent else ():
            tiles = cf.Tiles.parse(shape)
            try:
                ms = bench(lambda tiles=tiles: run("persistent", tiles))
            except Exception as exc:  # noqa: BLE001 (any compile or launch failure is this shape's result)
                row["shapes"][shape] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                print(f"B{batch} {shape}: {row['shapes'][shape]['error']}", flush=True)
                continue
            row["shapes"][shape] = {"ms": ms, "tb_per_s": weight_bytes / ms / 1e9}
            print(f"B{batch} {shape}: {ms * 1e3:.1f} us", flush=True)  # as it goes: a call can end early
        first = cf.Tiles.parse(shapes[0])
        # a cut's scratch is fresh: its numbers are garbage, its time is not
        for k in range(1, n_steps + 1 if per_step and persistent else 1):
            row["prefix_ms"].append(bench(lambda k=k, first=first: run("persistent", first, (0, k))))
            print(f"B{batch} steps 0..{k - 1}: {row['prefix_ms'][-1] * 1e3:.1f} us", flush=True)
        for s in range(n_steps if per_step and persistent else 0):
            row["phased_step_ms"].append(bench(lambda s=s, first=first: run("phased", first, (s, s + 1))))
        bars = torch.zeros(n_steps + 1, device=device, dtype=torch.int32)

        def barriers_only(bars=bars):
            bars.zero_()
            _barriers_only[(programs,)](bars, n_steps - 1, programs, SPIN_LIMIT=cf.SPIN_LIMIT)

        if persistent:
            row["barriers_only_ms"] = bench(barriers_only)
        if batch <= STREAM_ROWS:  # the streamed forward (engine.kernels.cp_stream) beside the layer path
            from engine.model.code_predictor import cp_forward_reference

            stream_counters = cf.barrier_counters(1, L, device)[0]

            def streamed(args=args, stream_counters=stream_counters, acquire_poll=False, layer_weights=True,
                         stamps=None, l2_prefetch=True):
                stream_counters.zero_()
                with torch.inference_mode():
                    stream_forward(*args, stream_counters, programs=programs, acquire_poll=acquire_poll,
                                   layer_weights=layer_weights, stamps=stamps, l2_prefetch=l2_prefetch)

            def layers(args=args):
                with torch.inference_mode():
                    cp_forward_reference(*args)

            row["streamed_ms"] = bench(streamed)
            row["streamed_acquire_poll_ms"] = bench(lambda: streamed(acquire_poll=True))
            with mock.patch.dict(os.environ, {WARPS_ENV: "16"}):
                row["streamed_warps16_ms"] = bench(streamed)
            row["streamed_no_prefetch_ms"] = bench(lambda: streamed(l2_prefetch=False))
            row["streamed_l2_weights_ms"] = bench(lambda: streamed(layer_weights=False))
            row["layers_ms"] = bench(layers)
            row["stream_timeouts"] = int(stream_counters[-1])
            with torch.inference_mode():  # the two logits apart, over the largest of the layer path's
                ours = stream_forward(*args, programs=programs).float()
                theirs = cp_forward_reference(*args).float()
            row["stream_vs_layers"] = float((ours - theirs).abs().max() / theirs.abs().max())
            print(f"B{batch} streamed {row['streamed_ms'] * 1e3:.1f} us (acquire polls "
                  f"{row['streamed_acquire_poll_ms'] * 1e3:.1f} us), layer by layer "
                  f"{row['layers_ms'] * 1e3:.1f} us", flush=True)
            if stamps:
                marks = torch.zeros(programs, stamp_marks(L), 2, device=device, dtype=torch.int64)
                for _ in range(3):  # warm
                    streamed(stamps=marks)
                runs = []
                for _ in range(stamps):
                    streamed(stamps=marks)
                    runs.append(marks.cpu().numpy().copy())
                row["timeline"] = timeline(np.stack(runs), L)
                row["stream_timeouts"] = int(stream_counters[-1])
                print(f"B{batch} timeline: {json.dumps(row['timeline'])}", flush=True)
        row["barrier_timeouts"] = int(counters[-1]) + (int(bars[-1]) if persistent else 0)
        record["batches"][str(batch)] = row
    return record


def step_name(step: int, layers: int) -> str:
    return "head" if step == 5 * layers else f"L{step // 5} {PHASE_NAMES[step % 5]}"


def print_tables(record: dict, layers: int) -> None:
    print(f"{record['gpu']}: {record['programs']} programs, {record['weight_bytes'] / 1e6:.1f} MB of weights a forward")
    for batch, row in record["batches"].items():
        print(f"\nB{batch}: whole forward per launch shape")
        for shape, r in row["shapes"].items():
            if "error" in r:
                print(f"  {shape:<28} {r['error']}")
            else:
                print(f"  {shape:<28} {r['ms'] * 1e3:8.1f} us  {r['tb_per_s']:5.2f} TB/s")
        if "barriers_only_ms" in row:
            print(f"  25 barriers alone: {row['barriers_only_ms'] * 1e3:.1f} us; "
                  f"barrier timeouts {row['barrier_timeouts']}")
        if "streamed_ms" in row:
            print(f"  streamed forward {row['streamed_ms'] * 1e3:.1f} us, with acquire polls "
                  f"{row['streamed_acquire_poll_ms'] * 1e3:.1f} us (timeouts {row['stream_timeouts']}; logits "
                  f"{row['stream_vs_layers']:.1e} from the layer path's); layer by layer "
                  f"{row['layers_ms'] * 1e3:.1f} us")
            print(f"  streamed with 16 warps {row['streamed_warps16_ms'] * 1e3:.1f} us, without L2 hints "
                  f"{row['streamed_no_prefetch_ms'] * 1e3:.1f} us; every layer on layer 0's weights (in L2) "
                  f"{row['streamed_l2_weights_ms'] * 1e3:.1f} us")
        if "timeline" in row:
            t = row["timeline"]
            print(f"B{batch}: streamed timeline over {t['launches']} launches, forward {t['forward_us']:.1f} us "
                  f"(timer step {t['timer_step_us']:.3f} us); per step kind, us: work (median, slowest program), "
                  f"arrival spread, wait, release")
            for name, k in t["kinds"].items():
                print(f"  {name:<5} {k['work_us']:7.2f} {k['work_slowest_us']:7.2f} {k['spread_us']:7.2f} "
                      f"{k['wait_us']:7.2f} {k['release_us']:7.2f}")
        print(f"B{batch}: step, persistent prefix rise (step + barrier) us, phased step alone us")
        previous = 0.0
        for s, (prefix, alone) in enumerate(zip(row["prefix_ms"], row["phased_step_ms"], strict=True)):
            print(f"  {s:>2} {step_name(s, layers):<9} {(prefix - previous) * 1e3:8.1f} {alone * 1e3:8.1f}")
            previous = prefix


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--model", default="random:1.7b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--shapes", nargs="+", default=["default"])
    ap.add_argument("--no-steps", action="store_true", help="the launch shapes only, not the per-step tables")
    ap.add_argument("--stream-only", action="store_true", help="the streamed forward and the layer path only")
    ap.add_argument("--stamps", type=int, default=0, help="launches of the streamed forward's timeline")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_cp_forward needs a CUDA device", file=sys.stderr)
        return 2
    from engine.model_source import load_model

    loaded = load_model(a.model, "cuda", torch.bfloat16)
    record = probe(loaded, a.batches, a.shapes, per_step=not a.no_steps, persistent=not a.stream_only,
                   stamps=a.stamps)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_cp_forward.json").write_text(json.dumps(record, indent=1))
    print_tables(record, loaded.tts.talker.code_predictor.model.cfg.num_layers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
