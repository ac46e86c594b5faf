"""GPU check of the language model's Triton kernels: correctness first, then time; then whole-model checks.

    python -m engine.tools.gpu_check_kernels OUT_DIR [--model random:1.7b] [--frames 64] [--batches 1 32]

1. Every kernel on random inputs (bfloat16 and float32, the 1.7B geometry, the edges: length 1, a full cache
   bucket, right-padded prefill rows) against its PyTorch reference. The error is measured against the reference
   run in float64 on the same inputs, for the kernel and for the PyTorch path alike: a kernel passes when it is
   within its dtype's tolerance, or no less accurate than the PyTorch path in the same dtype.
2. Each kernel timed against its reference with triton.testing.do_bench (median).
3. Whole model (--model, bfloat16, Triton path): greedy codes over --frames frames at each --batches size with
   CUDA graphs against eager (must be identical); the fused path against the PyTorch path in float32 (logits of
   a prefill and a decode step: must be close); and bfloat16 against float32 greedy codes, and codes after a
   prefill from a cached prompt prefix against the whole prompt's (agreement reported).

Writes OUT_DIR/gpu_check_kernels.json, prints a table last, exits 1 on any correctness failure. Shapes follow
the model's config. --smoke (tests): small sizes, float16/float32, on the CPU through triton's interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import kernels
from engine.kernels.compiled import COMPILE_ENV, compile_parts

TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda"


@dataclass(frozen=True)
class Sizes:
    dtypes: tuple = (torch.bfloat16, torch.float32)
    batches: tuple[int, ...] = (1, 8, 64)  # decode rows
    long_len: int = 3073  # the serving cache length (max_prompt_tokens 1024 + max_frames 2048 + 1)
    mid_len: int = 512
    many_rows: int = 64 * 64  # a B64 x 64-token prefill, flattened
    prefill: tuple[int, int] = (16, 64)  # batch, tokens
    model_dtype: torch.dtype = torch.bfloat16  # the whole-model checks' serving dtype (against float32)
    cp_starts: tuple[tuple[int, int], ...] = ((2, 0), (1, 15))  # Code Predictor forwards: (tokens, first position)
    cp_repeats: int = 20  # persistent launches compared with the first


SMOKE = Sizes(dtypes=(torch.float16, torch.float32), batches=(1, 3), long_len=40, mid_len=24, many_rows=12,
              prefill=(3, 8), model_dtype=torch.float32, cp_starts=((2, 0),), cp_repeats=1)


def _geometry(stack) -> dict:
    return {"H": stack.num_heads, "Hkv": stack.num_kv_heads, "D": stack.head_dim, "hidden": stack.hidden_size,
            "inter": stack.intermediate_size}


def _rel_err(got, want) -> float:
    want = want.double()
    return float((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-30))


def _bench_us(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")) * 1e3


def _as64(args):
    return [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


class KernelChecks:
    """Runs one case: kernel vs reference (both in the case's dtype) vs the reference in float64."""

    def __init__(self, time_it: bool, only: tuple[str, ...] = ()):
        self.rows: list[dict] = []
        self.time_it = time_it
        self.only = only  # kernel names to check (empty: all)

    def case(self, kernel: str, shape: str, dtype, fn, ref, make_args, outputs=lambda out: out) -> None:
        """make_args() -> fresh argument list (the kernels write caches in place, so each run gets its own)."""
        if self.only and kernel not in self.only:
            return
        got = outputs(fn(*make_args()))
        same_dtype = outputs(ref(*make_args()))
        exact = outputs(ref(*_as64(make_args())))
        got, same_dtype, exact = (x if isinstance(x, tuple) else (x,) for x in (got, same_dtype, exact))
        err = max(_rel_err(g, e) for g, e in zip(got, exact, strict=True))
        ref_err = max(_rel_err(r, e) for r, e in zip(same_dtype, exact, strict=True))
        finite = all(bool(torch.isfinite(g).all()) for g in got)
        ok = finite and (err <= TOLERANCE[dtype] or err <= 2 * ref_err)
        row = {"kernel": kernel, "shape": shape, "dtype": str(dtype).removeprefix("torch."), "rel_err": err,
               "torch_rel_err": ref_err, "ok": ok}
        if self.time_it:
            args = make_args()
            row["kernel_us"] = _bench_us(lambda: fn(*args))
            args = make_args()
            row["torch_us"] = _bench_us(lambda: ref(*args))
        self.rows.append(row)


def _rand(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def _norm_linear_reference(x, residual, norm_weight, eps, weight):
    from engine.kernels.norm import add_rms_norm_reference

    h, normed = add_rms_norm_reference(x, residual, norm_weight, eps)
    return h, torch.nn.functional.linear(normed, weight)


def kernel_checks(config, sizes: Sizes, time_it: bool, only: tuple[str, ...] = ()) -> list[dict]:
    from engine.kernels import attention as ka
    from engine.kernels import linear, norm
    from engine.kernels.pdl import PIPELINE_BLOCK_K
    from engine.model.layers import rope_cos_sin, signed_sin

    TALKER, CODE_PREDICTOR = _geometry(config.talker.stack), _geometry(config.talker.code_predictor)
    big = sizes.batches[-1]
    checks = KernelChecks(time_it, only)
    pipelined = linear.LinearConfig(block_k=PIPELINE_BLOCK_K, preload=True)  # a pipelined Code Predictor frame's

    def norm_linear(x, residual, norm_weight, eps, weight):
        return linear.skinny_norm_linear(x, linear.NormPrologue(residual, norm_weight, eps), weight, pipelined)

    for dtype in sizes.dtypes:
        cp = CODE_PREDICTOR
        for rows in (1, 2, 8):  # the folded norms of VOICELANE_PIPELINE_FOLD_NORMS: q/k/v and gate/up, with and without
            for name, N in (("qkv", (cp["H"] + 2 * cp["Hkv"]) * cp["D"]), ("gate_up", 2 * cp["inter"])):
                for first in (True, False):  # the first layer's norm is of x alone
                    x, r = _rand(rows, cp["hidden"], dtype=dtype), _rand(rows, cp["hidden"], dtype=dtype)
                    nw, w = (1 + 0.3 * _rand(cp["hidden"], dtype=dtype)), _rand(N, cp["hidden"], dtype=dtype)
                    checks.case("norm_linear", f"code predictor {name} {rows} rows{' first' if first else ''}",
                                dtype, norm_linear, _norm_linear_reference,
                                lambda x=x, r=r, nw=nw, w=w, first=first: [x, None if first else r, nw, 1e-6, w])
        for rows, hidden in ((1, TALKER["hidden"]), (big, TALKER["hidden"]), (sizes.many_rows, TALKER["hidden"]),
                             (15 * big, CODE_PREDICTOR["hidden"])):
            x, r, w = _rand(rows, hidden, dtype=dtype), _rand(rows, hidden, dtype=dtype), _rand(hidden, dtype=dtype)
            checks.case("add_rms_norm", f"{rows}x{hidden}", dtype, norm.add_rms_norm, norm.add_rms_norm_reference,
                        lambda x=x, r=r, w=w: [x, r, w, 1e-6])
        for rows, inter in ((1, TALKER["inter"]), (big, TALKER["inter"]), (sizes.many_rows, TALKER["inter"]),
                            (big, CODE_PREDICTOR["inter"])):
            gu = _rand(rows, 2 * inter, dtype=dtype, scale=3)
            checks.case("swiglu", f"{rows}x{inter}", dtype, norm.swiglu, norm.swiglu_reference, lambda gu=gu: [gu])

        def layer(B, T, geo, L, S, start, dtype=dtype):
            """Arguments of qk_norm_rope_store for B rows of T new tokens each, starting at column start[b]."""
            H, Hkv, D = geo["H"], geo["Hkv"], geo["D"]
            qkv = _rand(B, T, (H + 2 * Hkv) * D, dtype=dtype)
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
            positions = start[:, None] + torch.arange(T, device=DEVICE)
            cos, sin = rope_cos_sin(positions, D, 1e6, dtype)
            kc, vc = _rand(S, Hkv, L, D, dtype=dtype), _rand(S, Hkv, L, D, dtype=dtype)
            slots = torch.randperm(S, device=DEVICE)[:B]
            weights = [(1 + 0.3 * torch.randn(D, device=DEVICE)).to(dtype) for _ in range(2)]
            return [q, k, v, *weights, 1e-6, cos, signed_sin(sin), kc, vc, slots, positions]

        def with_start(B, L, T, full_row=True):
            start = torch.randint(0, L - T + 1, (B,), device=DEVICE)
            start[0] = 0  # a row of length 1 (T = 1)
            if full_row and B > 1:
                start[1] = L - T  # a row that fills the whole bucket
            return start

        pb, pt = sizes.prefill
        cp_len = config.talker.num_code_groups
        for name, B, T, geo, L in (("talker decode", 1, 1, TALKER, sizes.long_len),
                                   ("talker decode", big, 1, TALKER, sizes.long_len),
                                   ("prefill", pb, pt, TALKER, pt + 8),
                                   ("code predictor", big, 2, CODE_PREDICTOR, cp_len)):
            start = with_start(B, L, T) if name != "prefill" else torch.zeros(B, dtype=torch.int64, device=DEVICE)
            base = layer(B, T, geo, L, B + 1, start)

            def fresh(base=base):
                return [a.clone() if isinstance(a, torch.Tensor) and a.dim() == 4 else a for a in base]

            def with_cache(fn):
                # Compare the rotated q and the two caches it wrote (every column, so stray writes count too).
                def run(*args):
                    return fn(*args), args[8], args[9]
                return run

            checks.case("qk_norm_rope_store", f"{name} B{B} T{T}", dtype, with_cache(ka.qk_norm_rope_store),
                        with_cache(ka.qk_norm_rope_store_reference), fresh)

        def short(*args):  # one launch: the attention output and the two caches it wrote
            return ka.short_attention(*args), args[8], args[9]

        def short_reference(*args):
            rotated = ka.qk_norm_rope_store_reference(*args)
            return ka.cache_attention_reference(rotated, args[8], args[9], args[10], args[11]), args[8], args[9]

        for B, T in ((1, 2), (big, 2), (1, 1), (big, 1)):  # the Code Predictor's first forward and a later one
            start = torch.zeros(B, dtype=torch.int64, device=DEVICE) if T == 2 else with_start(B, cp_len, 1)
            base = layer(B, T, CODE_PREDICTOR, cp_len, B + 1, start)
            checks.case("short_attention", f"code predictor B{B} T{T}", dtype, short, short_reference,
                        lambda base=base: [a.clone() if isinstance(a, torch.Tensor) and a.dim() == 4 else a
                                           for a in base])

        def attention_case(name, B, T, geo, L, positions, valid_len=None, dtype=dtype):
            H, Hkv, D = geo["H"], geo["Hkv"], geo["D"]
            q = _rand(B, T, H, D, dtype=dtype)
            kc, vc = _rand(B + 1, Hkv, L, D, dtype=dtype), _rand(B + 1, Hkv, L, D, dtype=dtype)
            slots = torch.randperm(B + 1, device=DEVICE)[:B]
            kv_len = int(positions.max()) + 1  # the model's PyTorch path gathers up to its bucket, not a sync

            def ref(*args):
                return ka.cache_attention_reference(*args, kv_len=kv_len)

            checks.case("cache_attention", f"{name} B{B} T{T} L{L}", dtype, ka.cache_attention, ref,
                        lambda: [q, kc, vc, slots, positions, valid_len])

        for B in sizes.batches:
            for L, label in ((sizes.long_len, "full bucket"), (sizes.mid_len, "random lengths")):
                positions = with_start(B, L, 1, full_row=True)[:, None]
                if label == "full bucket":
                    positions[:] = L - 1
                attention_case(f"talker decode {label}", B, 1, TALKER, L, positions)
        for B in (1, pb):
            positions = torch.arange(pt, device=DEVICE).expand(B, pt)
            valid = torch.randint(1, pt + 1, (B,), device=DEVICE)
            valid[0] = pt
            attention_case("prefill padded", B, pt, TALKER, pt + 8, positions, valid)
            # after a cached prefix (the prefix cache): rows start at their prefix's length over columns already
            # there, one position (dual layout) or pt (whole), right-padded
            for T in (1, pt):
                start = torch.randint(1, 24, (B,), device=DEVICE)
                valid = start + torch.randint(1, T + 1, (B,), device=DEVICE)
                valid[0] = start[0] + T
                attention_case("prefill after a cached prefix", B, T, TALKER, 24 + pt + 8,
                               start[:, None] + torch.arange(T, device=DEVICE), valid)
        for B in (1, big):
            attention_case("code predictor first", B, 2, CODE_PREDICTOR, cp_len,
                           torch.arange(2, device=DEVICE).expand(B, 2))
            attention_case("code predictor last", B, 1, CODE_PREDICTOR, cp_len,
                           torch.full((B, 1), cp_len - 1, dtype=torch.int64, device=DEVICE))
    return checks.rows


# ---------------------------------------------------------------------------------------------- whole model
def cp_forward_checks(loaded, sizes: Sizes, time_it: bool) -> list[dict]:
    """engine.kernels.cp_forward (one Code Predictor forward and its head) in its modes against the model's own
    path, on the loaded model's weights and dtype: the logits and the caches written, each measured against a float32
    copy of the model (a case passes within its dtype's tolerance or no less accurate than the model's own path);
    persistent must equal phased exactly (the same arithmetic in the same order), over 20 launches (a barrier that
    let a program run ahead would show as a difference; sizes.cp_repeats) and count no barrier timeout."""
    import copy

    from engine.kernels import cp_forward as cf
    from engine.kernels import cp_stream as cs
    from engine.model.code_predictor import cp_forward_reference
    from engine.model.layers import rope_cos_sin, signed_sin

    cp = loaded.tts.talker.code_predictor
    cp32 = copy.deepcopy(cp).float()
    cfg = cp.model.cfg
    dtype = next(cp.parameters()).dtype
    big = sizes.batches[-1]
    rows = []
    for B, (T, start) in ((b, c) for b in (1, big) for c in sizes.cp_starts):
        g = torch.Generator(device=DEVICE).manual_seed(B + T + start)
        x = torch.randn(B, T, cfg.hidden_size, device=DEVICE, generator=g)
        positions = (torch.arange(T, device=DEVICE) + start).expand(B, T)
        slots = torch.arange(B, 0, -1, device=DEVICE)
        k0 = torch.randn(cfg.num_layers, B + 1, cfg.num_kv_heads, cp.positions, cfg.head_dim, device=DEVICE,
                         generator=g)
        v0 = torch.randn(k0.shape, device=DEVICE, generator=g)

        counters = cf.barrier_counters(1 + sizes.cp_repeats, cfg.num_layers, DEVICE)
        stream_counters = cf.barrier_counters(1 + sizes.cp_repeats, cfg.num_layers, DEVICE)
        launches = iter(counters)
        stream_launches = iter(stream_counters)

        def call(model, mode, dt, x=x, positions=positions, slots=slots, k0=k0, v0=v0, launches=launches,
                 stream_launches=stream_launches):
            cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dt)
            k, v = k0.to(dt), v0.to(dt)
            args = (model.model, x.to(dt), cos, signed_sin(sin), k, v, slots, positions, model.model.norm.weight,
                    model.lm_head[2].weight)
            with torch.inference_mode():
                if mode == "model":
                    logits = cp_forward_reference(*args)
                elif mode == "streamed":
                    logits = cs.stream_forward(*args, next(stream_launches))
                else:
                    logits = cf.cp_forward(*args, mode, next(launches) if mode == "persistent" else None)
            return (logits, k, v), args

        truth, _ = call(cp32, "model", torch.float32)
        own, _ = call(cp, "model", dtype)
        phased, _ = call(cp, "phased", dtype)
        persistent, args = call(cp, "persistent", dtype)
        again = [call(cp, "persistent", dtype)[0] for _ in range(sizes.cp_repeats)]
        err = max(_rel_err(a, b) for a, b in zip(persistent, truth, strict=True))
        own_err = max(_rel_err(a, b) for a, b in zip(own, truth, strict=True))
        exact = all(torch.equal(a, b) for a, b in zip(persistent, phased, strict=True))
        timeouts = cf.barrier_timeouts(counters)
        stable = all(torch.equal(r[0], persistent[0]) for r in again)
        row = {"kernel": "cp_forward", "shape": f"B{B} T{T} from position {start}", "dtype": str(dtype).removeprefix(
            "torch."), "rel_err": err, "torch_rel_err": own_err, "persistent_equals_phased": exact,
            "persistent_repeats_equal": stable, "barrier_timeouts": timeouts,
            "ok": exact and stable and not timeouts and (err <= TOLERANCE[dtype] or err <= 2 * own_err)}
        if time_it:
            row["kernel_us"] = _bench_us(lambda args=args: cf.cp_forward(*args, "persistent"))
            row["phased_us"] = _bench_us(lambda args=args: cf.cp_forward(*args, "phased"))
            row["torch_us"] = _bench_us(lambda args=args: cp_forward_reference(*args))
        rows.append(row)
        if B * T > cs.STREAM_ROWS:
            continue
        # the streamed forward (engine.kernels.cp_stream): its sums run in another order, so no exact twin; the
        # same result every launch, no timeout, and as accurate as the persistent one is asked to be
        streamed, args = call(cp, "streamed", dtype)
        again = [call(cp, "streamed", dtype)[0] for _ in range(sizes.cp_repeats)]
        err = max(_rel_err(a, b) for a, b in zip(streamed, truth, strict=True))
        timeouts = cf.barrier_timeouts(stream_counters)
        stable = all(torch.equal(r[0], streamed[0]) for r in again)
        rows.append({"kernel": "cp_stream", "shape": row["shape"], "dtype": row["dtype"], "rel_err": err,
                     "torch_rel_err": own_err, "repeats_equal": stable, "barrier_timeouts": timeouts,
                     "ok": stable and not timeouts and (err <= TOLERANCE[dtype] or err <= 2 * own_err)})
        if time_it:
            rows[-1]["kernel_us"] = _bench_us(lambda args=args: cs.stream_forward(*args))
            rows[-1]["torch_us"] = row["torch_us"]
    return rows


def greedy_codes(loaded, batch: int, frames: int, graphs: str, cached_prefix: bool = False) -> torch.Tensor:
    """Drive the runner's stages (prefill, then Code Predictor and Talker per frame) for `batch` greedy rows with
    distinct prompts; -> codes [batch, frames, 16]. cached_prefix: the prefill runs twice, the second time after
    the prompts' prefix from the prefix cache (off: no prefix cache)."""
    from engine.config import EngineConfig, SchedulerConfig
    from engine.model.prompt import build_prompt, resolve_voice
    from engine.model.sampling_params import SamplingParams
    from engine.runner import Runner
    from engine.types import RowPlan, Stage, StagePlan

    cfg = EngineConfig(scheduler=SchedulerConfig(max_slots=batch), max_frames=frames + 1, max_prompt_tokens=64,
                       cuda_graphs=graphs, prefix_cache_entries=256 if cached_prefix else 0)
    runner = Runner(loaded, cfg)
    voice = resolve_voice(loaded.config, "ryan", "english")
    greedy = SamplingParams(temperature=0.0, sub_temperature=0.0, seed=1, max_frames=frames + 1)
    prompts = [build_prompt(loaded.config, voice, list(range(1000 + 3 * i, 1012 + 5 * (i % 4) + 3 * i)), "whole",
                            None) for i in range(batch)]

    def run(stage, rows):
        result = runner.collect(runner.launch(StagePlan(stage, rows)))
        if any(result.failed):
            raise RuntimeError(f"{stage.value} failed: {next(f for f in result.failed if f)}")

    for _ in range(2 if cached_prefix else 1):
        run(Stage.PREFILL, [RowPlan(i, i, i, 0, prompt=prompts[i], sampling=greedy, eos_allowed=False)
                            for i in range(batch)])
    if cached_prefix and runner.prefix_cache.hits != batch:
        raise RuntimeError(f"prefix cache: {runner.prefix_cache.hits} hits of {batch} rows")
    for s in range(frames):
        run(Stage.CODE_PREDICTOR, [RowPlan(i, i, i, s) for i in range(batch)])
        if s + 1 < frames:
            run(Stage.TALKER, [RowPlan(i, i, i, s, text_id=loaded.config.tts_pad_id, eos_allowed=False)
                               for i in range(batch)])
    if runner.graph_failure:
        raise RuntimeError(f"graph capture failed: {runner.graph_failure}")
    return runner.frames[:batch, :frames].cpu()


def logits_fused_vs_torch(loaded) -> dict:
    """float32: the Talker's prefill and decode-step outputs on the fused path against the PyTorch path."""
    talker = loaded.tts.talker
    g = torch.Generator(device=DEVICE).manual_seed(0)
    B, L = 4, 12
    x = torch.randn(B, L, talker.cfg.stack.hidden_size, device=DEVICE, generator=g)
    step = torch.randn(B, 1, talker.cfg.stack.hidden_size, device=DEVICE, generator=g)
    length = torch.tensor([12, 1, 5, 9], device=DEVICE)
    slots = torch.tensor([3, 0, 4, 1], device=DEVICE)
    out = {}
    for name in ("torch", "triton"):
        cache = talker.new_cache(5, 16, DEVICE, torch.float32)
        with kernels.backend(name), torch.inference_mode():
            _, prefill = talker(x, slots, torch.arange(L, device=DEVICE).expand(B, L), cache, L, last=length - 1,
                                valid_len=length)
            _, decode = talker(step, slots, length[:, None], cache, L + 1,
                               last=torch.zeros(B, dtype=torch.int64, device=DEVICE))
        out[name] = (prefill, decode)
    errs = [_rel_err(a, b) for a, b in zip(out["triton"], out["torch"], strict=True)]
    return {"check": "fp32 fused vs PyTorch logits (prefill, decode)", "rel_err": max(errs), "ok": max(errs) < 1e-4}


def graphs_vs_eager(loaded, batch: int, frames: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Greedy codes with CUDA graphs (emulated on the CPU) against eager: must be identical."""
    graphs = "on" if DEVICE == "cuda" else "emulate"
    t0 = time.monotonic()
    eager = greedy_codes(loaded, batch, frames, "off")
    graphed = greedy_codes(loaded, batch, frames, graphs)
    return ({"check": f"{loaded.dtype} greedy codes, graphs {graphs} vs eager, B{batch} x {frames} frames",
             "agreement": float((eager == graphed).float().mean()), "ok": bool(torch.equal(eager, graphed)),
             "first_divergent_frame": first_divergent_frame(eager, graphed),
             "seconds": round(time.monotonic() - t0, 1)}, eager, graphed)


def first_divergent_frame(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """codes [B, frames, 16] twice -> the first frame where any row differs (None: identical)."""
    differs = (a != b).flatten(2).any(dim=2).any(dim=0).nonzero()
    return int(differs[0]) if len(differs) else None


def compiled_vs_uncompiled(loaded, batch: int, frames: int, eager: torch.Tensor) -> dict:
    """With VOICELANE_COMPILE on, `eager` ran the compiled parts: their greedy codes against the same run with
    nothing compiled, i.e. inductor's fused arithmetic against the kernels it replaces. Reported: in bfloat16 a
    fused kernel rounds its intermediates differently, as the Triton path against the PyTorch path does."""
    parts = sorted(compile_parts())
    saved = os.environ.get(COMPILE_ENV)
    os.environ[COMPILE_ENV] = "off"
    try:
        plain = greedy_codes(loaded, batch, frames, "off")
    finally:
        if saved is None:
            os.environ.pop(COMPILE_ENV)
        else:
            os.environ[COMPILE_ENV] = saved
    return {"check": f"{loaded.dtype} greedy codes, compiled ({'+'.join(parts)}) vs not compiled, eager, "
            f"B{batch} x {frames} frames (reported)", "agreement": float((plain == eager).float().mean()),
            "first_divergent_frame": first_divergent_frame(plain, eager), "ok": True}


def repeatability(loaded, batch: int, frames: int, eager: torch.Tensor, graphed: torch.Tensor) -> list[dict]:
    """Each mode run a second time in a fresh runner: tells a systematic difference between graphs and eager from
    run-to-run nondeterminism (reported; the check above is the one that must hold)."""
    graphs = "on" if DEVICE == "cuda" else "emulate"
    rows = []
    for mode, first in (("off", eager), (graphs, graphed)):
        again = greedy_codes(loaded, batch, frames, mode)
        rows.append({"check": f"{loaded.dtype} greedy codes, graphs {mode} run twice, B{batch} x {frames} frames "
                     "(reported)", "agreement": float((again == first).float().mean()),
                     "first_divergent_frame": first_divergent_frame(first, again), "ok": True})
    return rows


def whole_model(bf16, model: str, frames: int, batches: list[int]) -> list[dict]:
    from engine.model_source import load_model as load

    rows = []
    graphs = "on" if DEVICE == "cuda" else "emulate"
    for batch in batches:
        row, eager, graphed = graphs_vs_eager(bf16, batch, frames)
        rows.append(row)
        if kernels.pdl(torch.device(DEVICE)):  # the same arithmetic in the same order: identical codes
            with kernels.pdl_mode("off"):
                serial = greedy_codes(bf16, batch, frames, graphs)
            rows.append({"check": f"{bf16.dtype} greedy codes, graphs {graphs} with programmatic dependent launch "
                         f"vs without, B{batch} x {frames} frames", "ok": torch.equal(serial, graphed),
                         "agreement": float((serial == graphed).float().mean())})
        cached = greedy_codes(bf16, batch, frames, graphs, cached_prefix=True)
        rows.append({"check": f"{bf16.dtype} greedy codes, prefill after a cached prefix vs the whole prompt, "
                     f"graphs {graphs}, B{batch} x {frames} frames (reported: the prefill's shapes differ)",
                     "agreement": float((cached == graphed).float().mean()), "ok": True})
        if batch == batches[0]:
            first_bf16 = eager
    fp32 = load(model, DEVICE, torch.float32)
    rows.append(logits_fused_vs_torch(fp32))
    b = batches[0]
    fp32_codes = greedy_codes(fp32, b, frames, "off")
    agree = (fp32_codes == first_bf16).float()
    diverged = (agree.min(dim=-1).values < 1).nonzero()
    rows.append({"check": f"{bf16.dtype} vs fp32 greedy codes (fused path), B{b} x {frames} frames (reported)",
                 "agreement": float(agree.mean()),
                 "first_divergent_frame": int(diverged[0, 1]) if len(diverged) else None, "ok": True})
    cached = greedy_codes(fp32, b, frames, "off", cached_prefix=True)
    rows.append({"check": f"fp32 greedy codes, prefill after a cached prefix vs the whole prompt, B{b} x {frames} "
                 "frames (identical on the CPU; reported)", "agreement": float((cached == fp32_codes).float().mean()),
                 "ok": True})
    with kernels.backend("torch"):
        torch_fp32 = greedy_codes(fp32, b, frames, "off")
    rows.append({"check": f"fp32 greedy codes, fused vs PyTorch path, B{b} x {frames} frames (reported)",
                 "agreement": float((torch_fp32 == fp32_codes).float().mean()), "ok": True})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--model", default="random:1.7b")
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--no-time", action="store_true", help="correctness only")
    ap.add_argument("--no-model", action="store_true", help="kernels only")
    ap.add_argument("--cp-forward-only", action="store_true",
                    help="of the kernel checks, only cp_forward's (a cold GPU compiles far fewer kernels)")
    ap.add_argument("--kernels", nargs="+", default=(), metavar="NAME",
                    help="of the kernel checks, only these kernels' (e.g. norm_linear)")
    ap.add_argument("--graphs-only", action="store_true", help="only greedy codes with graphs against eager, in the "
                    "model's dtype, at each --batches size: the runner's check after a change to its graphs, in "
                    "one model load")
    ap.add_argument("--repeat-check", action="store_true", help="with --graphs-only: run eager and graphs a second "
                    "time each and report whether each repeats itself (a difference that is nondeterminism, or not)")
    ap.add_argument("--smoke", action="store_true", help="tests: tiny sizes on the CPU (TRITON_INTERPRET=1)")
    a = ap.parse_args(argv)
    global DEVICE
    if not a.smoke:
        if not torch.cuda.is_available():
            print("gpu_check_kernels needs a CUDA device", file=sys.stderr)
            return 2
        return check(a, Sizes())
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("--smoke runs the kernels on the CPU: set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    DEVICE = "cpu"
    try:
        with kernels.backend("triton"):
            return check(a, SMOKE)
    finally:
        DEVICE = "cuda"


def check(a: argparse.Namespace, sizes: Sizes) -> int:
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from engine.model_source import load_model as load

    status = kernels.kernels_status()
    record = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else None, "torch": torch.__version__,
              "kernels": status, "model": a.model}
    if not kernels.use_triton(torch.device(DEVICE)):
        print(f"the Triton kernels are not in use on {DEVICE}: {status}", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    t0 = time.monotonic()
    loaded = load(a.model, DEVICE, sizes.model_dtype)
    time_it = not a.no_time and DEVICE == "cuda"
    if a.graphs_only:
        record["kernels_checked"] = []
        record["model_checks"] = []
        for b in a.batches:
            row, eager, graphed = graphs_vs_eager(loaded, b, a.frames)
            record["model_checks"].append(row)
            if compile_parts():
                record["model_checks"].append(compiled_vs_uncompiled(loaded, b, a.frames, eager))
            if a.repeat_check:
                record["model_checks"] += repeatability(loaded, b, a.frames, eager, graphed)
    else:
        record["kernels_checked"] = \
            ([] if a.cp_forward_only else kernel_checks(loaded.config, sizes, time_it, tuple(a.kernels))) \
            + ([] if a.kernels and "cp_forward" not in a.kernels else cp_forward_checks(loaded, sizes, time_it))
        record["kernel_seconds"] = round(time.monotonic() - t0, 1)
        record["model_checks"] = [] if a.no_model else whole_model(loaded, a.model, a.frames, a.batches)
    record["seconds"] = round(time.monotonic() - t0, 1)
    (out / "gpu_check_kernels.json").write_text(json.dumps(record, indent=1))

    failed = [r for r in record["kernels_checked"] + record["model_checks"] if not r["ok"]]
    for r in record["model_checks"]:
        detail = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("check", "ok"))
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['check']}: {detail}")
    print(f"\n{'kernel':<19} {'case':<40} {'dtype':<9} {'rel err':>9} {'torch err':>9} {'us':>8} {'torch us':>9} "
          f"{'x':>6}  ok")
    for r in record["kernels_checked"]:
        us, tus = r.get("kernel_us", float("nan")), r.get("torch_us", float("nan"))
        print(f"{r['kernel']:<19} {r['shape']:<40} {r['dtype']:<9} {r['rel_err']:>9.2e} {r['torch_rel_err']:>9.2e} "
              f"{us:>8.1f} {tus:>9.1f} {tus / us:>6.1f}  {'ok' if r['ok'] else 'FAIL'}")
    print(f"\n{len(failed)} failure(s); {record['seconds']} s; JSON in {out / 'gpu_check_kernels.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
