"""Measure the skinny linear kernel against cuBLAS for every decode GEMM of the models, and write the table the
engine reads (engine/kernels/linear_table.json's format).

    python -m engine.tools.tune_linear OUT_DIR [--sizes 1.7b 0.6b] [--rows 1 2 4 8 16 32 64]

For each weight shape (each stack's q/k/v, o, gate/up, down with SwiGLU folded in, and the output heads) and each
row bucket: every candidate config and cuBLAS (F.linear, after the SwiGLU kernel for the down projection: what
the engine runs without the table) are launched back to back over enough copies of the weight to exceed the L2
cache (the model's weights stream from HBM, never from L2), inside one CUDA graph as the engine runs them; the
time is one launch's share of a replay (median of several). A candidate counts only if its result is as close
to the float32 reference as cuBLAS's (or within bf16's tolerance). The table keeps, per shape and bucket, the
fastest correct kernel config, and uses it where it beats cuBLAS by at least 3% (else cuBLAS).

Writes OUT_DIR/linear_tune.json (every measurement) and OUT_DIR/linear_table.json ({gpu name: {key: entry}}).
--smoke (tests): tiny shapes, a few candidates, on the CPU through triton's interpreter, no timing.
--from TUNE_JSON: no measuring; write the table again from a linear_tune.json (e.g. after a format change).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from engine.model.config import ModelConfig
from engine.model.presets import model_config

L2_BYTES = 60 * 2**20  # the H200's L2 is 50 MB: copies of a weight fill more than that
MIN_GAIN = 0.03


def shapes(size: str) -> list[tuple[str, int, int, bool]]:
    """(name, N, K, swiglu) of every decode GEMM of a model size: weight [N, K]."""
    talker = ModelConfig.from_dict(model_config(size)).talker
    out = []
    for stack_name, stack, head_rows in (("talker", talker.stack, talker.stack.vocab_size),
                                         ("cp", talker.code_predictor, talker.code_predictor.vocab_size)):
        h, q, kv = stack.hidden_size, stack.num_heads * stack.head_dim, stack.num_kv_heads * stack.head_dim
        out += [(f"{stack_name}.qkv", q + 2 * kv, h, False), (f"{stack_name}.o", h, q, False),
                (f"{stack_name}.gate_up", 2 * stack.intermediate_size, h, False),
                (f"{stack_name}.down", h, stack.intermediate_size, True), (f"{stack_name}.head", head_rows, h, False)]
    return out


def candidates(rows: int, smoke: bool):
    from engine.kernels.linear import LinearConfig

    if smoke:
        return [LinearConfig(16, 32, 1, True, 4, 2), LinearConfig(16, 32, 2, False, 4, 2)]
    out = [LinearConfig(n, k, s, True, 4, st)
           for n, k, s, st in itertools.product((32, 64), (128, 256), (1, 2, 4, 8), (3, 4))]
    if rows <= 4:
        out += [LinearConfig(n, k, s, False, 4, 3) for n, k, s in itertools.product((16, 32), (128, 256), (1, 2, 4, 8))]
    return out


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max().clamp(min=1e-30))


def _graph_us(fn, copies: int, repeat: int = 7) -> float:
    """One launch's share of a CUDA graph holding `fn` (which launches `copies` times), median of replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the graph: compiles, allocates tickets
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    from engine.tools.gpu_check_codec import time_graph

    return time_graph(graph, repeat) * 1e3 / copies


def tune_shape(name: str, N: int, K: int, swiglu: bool, rows_list, device, dtype, smoke: bool) -> list[dict]:
    from engine.kernels import linear as kl

    g = torch.Generator(device="cpu").manual_seed(N * 7 + K)
    weight_bytes = N * K * torch.finfo(dtype).bits // 8
    copies = 1 if smoke else max(2, -(-L2_BYTES // weight_bytes) + 1)
    weights = [(torch.randn(N, K, generator=g) * K**-0.5).to(device, dtype) for _ in range(copies)]
    results = []
    for rows in rows_list:
        x = torch.randn(rows, 2 * K if swiglu else K, generator=g).to(device, dtype)
        want = kl.reference(x.double(), weights[0].double(), swiglu).float()
        base = {"shape": name, "N": N, "K": K, "swiglu": swiglu, "rows": rows}
        cublas_err = _rel_err(kl.reference(x, weights[0], swiglu) if smoke else
                              torch.nn.functional.linear(kl.swiglu_kernel(x) if swiglu else x, weights[0]), want)
        row = base | {"cublas_err": cublas_err, "candidates": []}
        if not smoke:
            row["cublas_us"] = _graph_us(
                lambda x=x: [torch.nn.functional.linear(kl.swiglu_kernel(x) if swiglu else x, w) for w in weights],
                copies)
        for config in candidates(rows, smoke):
            try:
                err = _rel_err(kl.skinny_linear(x, weights[0], config, swiglu), want)
                us = None if smoke else _graph_us(lambda c=config, x=x: [kl.skinny_linear(x, w, c, swiglu)
                                                                         for w in weights], copies)
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile or run is recorded, not used
                row["candidates"].append({"config": kl.config_dict(config), "error": f"{type(exc).__name__}: {exc}"})
                continue
            ok = err <= max(2 * cublas_err, 1e-5 if dtype == torch.float32 else 1e-2)
            row["candidates"].append({"config": kl.config_dict(config), "us": us, "err": err, "ok": ok})
        results.append(row)
        if not smoke:
            best = pick(row)
            print(f"{name:14s} N={N:5d} K={K:5d} rows={rows:2d} cublas {row['cublas_us']:7.2f} us  "
                  f"best {best[1] if best[0] else row['cublas_us']:7.2f} us  {best[0]}", flush=True)
    return results


def pick(row: dict) -> tuple[dict | None, float | None]:
    """(the fastest correct config if it beats cuBLAS by MIN_GAIN, else None; its time)."""
    best = fastest(row)
    if best is not None and best["us"] <= row["cublas_us"] * (1 - MIN_GAIN):
        return best["config"], best["us"]
    return None, None if best is None else best["us"]


def fastest(row: dict) -> dict | None:
    """The fastest correct candidate of a measured row (None: none was correct, or nothing was timed)."""
    good = [c for c in row["candidates"] if c.get("ok") and c.get("us") is not None]
    if not good or "cublas_us" not in row:
        return None
    return min(good, key=lambda c: c["us"])


def table_entry(row: dict) -> dict:
    best = fastest(row)
    return {"use": "skinny" if pick(row)[0] is not None else "cublas",
            "skinny": None if best is None else best["config"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--sizes", nargs="+", default=["1.7b", "0.6b"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--from", dest="from_json", help="a linear_tune.json: write its table, measure nothing")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        record = json.loads(Path(args.from_json).read_text())
        return 1 if write(out, record["gpu"], record["dtype"], time.time() - record["seconds"], record["rows"]) else 0
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    gpu = "cpu" if args.smoke else torch.cuda.get_device_name(device)
    todo = {}
    for size in (["tiny"] if args.smoke else args.sizes):
        for name, N, K, swiglu in shapes(size):
            todo.setdefault((N, K, swiglu), f"{size}.{name}")
    rows_list = [1, 3] if args.smoke else args.rows
    t0 = time.time()
    measured: list[dict] = []
    for (N, K, swiglu), name in todo.items():
        measured += tune_shape(name, N, K, swiglu, rows_list, device, dtype, args.smoke)
        failures = write(out, gpu, dtype, t0, measured)  # after every shape: a call cut short keeps what it measured
    taken = sum(pick(r)[0] is not None for r in measured)
    print(f"{len(measured)} shape x rows measured in {time.time() - t0:.1f} s; {taken} take the kernel; "
          f"{failures} with no correct candidate")
    return 1 if failures else 0


def write(out: Path, gpu: str, dtype, t0: float, measured: list[dict]) -> int:
    """Write linear_tune.json and linear_table.json; -> how many shape x rows have no correct candidate."""
    from engine.kernels import linear as kl

    table = {kl.entry_key(r["N"], r["K"], r["swiglu"], r["rows"]): table_entry(r) for r in measured}
    failures = [r for r in measured if not any(c.get("ok") for c in r["candidates"])]
    record = {"gpu": gpu, "torch": torch.__version__, "dtype": str(dtype), "seconds": round(time.time() - t0, 1),
              "min_gain": MIN_GAIN, "rows": measured, "failures": len(failures)}
    (out / "linear_tune.json").write_text(json.dumps(record, indent=1))
    (out / "linear_table.json").write_text(json.dumps({gpu: table}, indent=1, sort_keys=True))
    return len(failures)


if __name__ == "__main__":
    sys.exit(main())
