"""GPU check of the fused sampler (engine/kernels/sampler.py): correctness against the PyTorch reference first, then
timings, then the Code Predictor's 15-code loop end to end. Needs a CUDA GPU; about a minute on an H200.

    python -m engine.tools.gpu_check_sampler OUT_DIR [--skip-model]

1. Token ids, kernel vs `choose` (and `process_talker_logits` for the Talker's rules), on random logits in bf16
   and fp32, B in 1 8 32 64, V in 2048 3072, rows of mixed settings. Greedy rows and sampled rows without top-p
   must match exactly; sampled rows with top_p < 1 may differ only where a mass sits within rounding of top_p
   (allowed: under 0.5 % of them). Plus the draw that a float32 uniform would round to 1.0 (+inf noise).
2. Median device time (triton.testing.do_bench) of one draw, kernel vs reference; then every launch variant
   (radix digit bits, warps) inside a CUDA graph, as the engine runs it: device time per draw and its ids.
3. The Code Predictor loop (random:1.7b, bf16, prepared tables) at B1 and B64: reference vs kernel eagerly,
   the kernel in a CUDA graph, greedy and sampled codes kernel == reference and graph == eager.

Writes OUT_DIR/gpu_check_sampler.json; prints a table last; exits 1 on a correctness failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

from engine.kernels import sampler as kernel
from engine.model import sampling
from engine.model.sampling import SamplerRows, TalkerRules, _hash_bits, choose, process_talker_logits

TOP_P_MISMATCH_ALLOWED = 0.005


def mixed_rows(gen: torch.Generator, B: int, V: int, device) -> tuple[SamplerRows, torch.Tensor]:
    """Greedy beside sampled, top-k off / 1 / 50 / V, top-p off and on, large seeds, scattered counters."""
    def pick(options: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(options, dtype=dtype)[torch.randint(0, len(options), (B,), generator=gen)]

    rows = SamplerRows(pick([0.0, 0.9, 0.9, 1.0, 0.4], torch.float32), pick([0, 1, 50, 50, V - 1, V], torch.int64),
                       pick([1.0, 1.0, 1.0, 0.9, 0.6], torch.float32), torch.randint(0, 2**62, (B,), generator=gen))
    counter = torch.randint(0, 2**20, (B,), generator=gen)
    return SamplerRows(*(t.to(device) for t in (rows.temperature, rows.top_k, rows.top_p, rows.seed))), \
        counter.to(device)


def talker_rules(gen: torch.Generator, B: int, V: int, device) -> TalkerRules:
    suppress = torch.zeros(V, dtype=torch.bool)
    suppress[-1024:] = True
    eos = V - 1024 + 2
    suppress[eos] = False
    return TalkerRules((torch.rand(B, V, generator=gen) < 0.05).to(device),
                       torch.full((B,), 1.05).to(device), (torch.rand(B, generator=gen) < 0.5).to(device),
                       suppress.to(device), eos)


def fused_draw(logits, rows: SamplerRows, counter, rules: TalkerRules | None):
    return kernel.fused_sample(logits, rows.temperature, rows.top_k, rows.top_p, rows.seed, counter,
                               rules.as_tuple() if rules else None)


def reference_draw(logits, rows: SamplerRows, counter, rules: TalkerRules | None):
    x = logits.float()
    if rules:
        x = process_talker_logits(x, rules.seen, rules.penalty, rules.allow_eos, rules.suppress, rules.eos_id)
    return choose(x, rows, counter)


def frame_codes(model, hidden, code0, rows: SamplerRows, frame):
    return model.codes_1_to_15(hidden, code0, rows, frame)[0]


def correctness(device, repeats: int) -> tuple[list[dict], list[str]]:
    rows_out, failures = [], []
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for V in (2048, 3072):
            for B in (1, 8, 32, 64):
                counts = {"greedy": [0, 0], "sampled": [0, 0], "top_p": [0, 0]}  # [mismatches, rows]
                for _ in range(repeats):
                    logits = (torch.randn(B, V, generator=gen) * 3).to(device=device, dtype=dtype)
                    rows, counter = mixed_rows(gen, B, V, device)
                    rules = talker_rules(gen, B, V, device) if V == 3072 else None
                    got = fused_draw(logits, rows, counter, rules)
                    ref = reference_draw(logits, rows, counter, rules)
                    differ = (got != ref).cpu()
                    greedy = (rows.temperature <= 0).cpu()
                    nucleus = (~greedy) & (rows.top_p < 1).cpu()
                    for name, mask in (("greedy", greedy), ("sampled", ~greedy & ~nucleus), ("top_p", nucleus)):
                        counts[name][0] += int(differ[mask].sum())
                        counts[name][1] += int(mask.sum())
                    if not bool(((got >= 0) & (got < V)).all()):
                        failures.append(f"ids outside [0, {V}) for {dtype} B{B}")
                row = {"dtype": str(dtype).removeprefix("torch."), "V": V, "B": B, "talker_rules": V == 3072,
                       **{f"{k}_mismatch": v[0] for k, v in counts.items()}, **{f"{k}_rows": v[1] for k, v in
                                                                                counts.items()}}
                rows_out.append(row)
                where = f"{row['dtype']} V{V} B{B}"
                if counts["greedy"][0] or counts["sampled"][0]:
                    failures.append(f"{where}: {counts['greedy'][0]} greedy and {counts['sampled'][0]} sampled "
                                    "(top_p = 1) ids differ from the reference")
                if counts["top_p"][0] > TOP_P_MISMATCH_ALLOWED * max(counts["top_p"][1], 1):
                    failures.append(f"{where}: {counts['top_p'][0]} of {counts['top_p'][1]} top-p rows differ")
    failures += extreme_draw(device)
    return rows_out, failures


def extreme_draw(device) -> list[str]:
    """Seed 1's largest 32-bit draw over 12000 counters (a float32 uniform would round it to 1.0): that column,
    masked or far below the others, must not be chosen."""
    V = 3072
    bits = _hash_bits(torch.ones(12000, dtype=torch.int64, device=device), torch.arange(12000, device=device), V)
    flat = int(bits.argmax())
    counter, col = divmod(flat, V)
    logits = torch.zeros(2, V, device=device)
    logits[0, col], logits[1, col] = -30.0, float("-inf")
    ones = torch.ones(2, device=device)
    got = kernel.fused_sample(logits, ones, torch.zeros(2, dtype=torch.int64, device=device), ones,
                              torch.ones(2, dtype=torch.int64, device=device),
                              torch.full((2,), counter, dtype=torch.int64, device=device))
    return [] if bool((got != col).all()) else [f"the near-1.0 draw (counter {counter}, column {col}) was chosen"]


def timings(device) -> list[dict]:
    from triton.testing import do_bench

    out = []
    gen = torch.Generator().manual_seed(1)
    settings = {"default (t0.9 k50 p1)": (0.9, 50, 1.0), "greedy": (0.0, 0, 1.0),
                "top-p 0.8 (t0.9 k50)": (0.9, 50, 0.8)}
    for V in (2048, 3072):
        for B in (1, 64):
            logits = (torch.randn(B, V, generator=gen) * 3).to(device=device, dtype=torch.bfloat16)
            counter = torch.arange(B, device=device)
            rules = talker_rules(gen, B, V, device) if V == 3072 else None
            for name, (t, k, p) in settings.items():
                rows = SamplerRows(torch.full((B,), t, device=device), torch.full((B,), k, device=device),
                                   torch.full((B,), p, device=device), torch.arange(B, device=device) + 7)
                args = (logits, rows, counter, rules)
                out.append({"V": V, "B": B, "rows": name, "talker_rules": rules is not None,
                            "kernel_us": round(do_bench(partial(fused_draw, *args), return_mode="median") * 1e3, 2),
                            "reference_us": round(do_bench(partial(reference_draw, *args), return_mode="median")
                                                  * 1e3, 2)})
    return out


VARIANTS = ((8, None), (4, None), (2, None), (4, 8), (4, 16), (8, 16))  # (digit bits, warps; None: the default)


def graph_timings(device, shapes=((2048, 1), (2048, 64), (3072, 1), (3072, 64)), scales=(0.64, 3.0),
                  draws: int = 20, replays: int = 20) -> tuple[list[dict], list[str]]:
    """Each launch variant as the engine runs it: `draws` draws captured in one CUDA graph, device time per draw
    from events around `replays` replays (no host launch cost in it; CUDA only). Ids: every variant equals the
    first on every row, and the reference on rows without top-p (top-p may differ within rounding, see above).
    V 3072 rows carry the Talker's rules."""
    out, failures = [], []
    gen = torch.Generator().manual_seed(2)
    for V, B in shapes:
        for scale in scales:  # random weights' logit spread, and a peakier one
            logits = (torch.randn(B, V, generator=gen) * scale).to(device=device, dtype=torch.bfloat16)
            rules = talker_rules(gen, B, V, device) if V == 3072 else None
            default = SamplerRows(torch.full((B,), 0.9, device=device), torch.full((B,), 50, device=device),
                                  torch.full((B,), 1.0, device=device), torch.arange(B, device=device) + 7)
            for name, rows in (("default (t0.9 k50 p1)", default), ("mixed", mixed_rows(gen, B, V, device)[0])):
                counter = torch.arange(B, device=device) * 3
                want = reference_draw(logits, rows, counter, rules)
                exact = rows.top_p >= 1.0
                first = None
                for bits, warps in VARIANTS:
                    space = kernel.scratch(B, V, device)
                    args = (logits, rows.temperature, rows.top_k, rows.top_p, rows.seed, counter,
                            rules.as_tuple() if rules else None, space)
                    got = kernel.launch(*args, digit_bits=bits, num_warps=warps)
                    first = got if first is None else first
                    ok = bool(torch.equal(got[exact], want[exact]) and torch.equal(got, first))
                    if not ok:
                        failures.append(f"sampler variant V{V} B{B} x{scale} {name} bits {bits} warps "
                                        f"{warps or 'default'}: ids differ")
                    row = {"V": V, "B": B, "scale": scale, "rows": name, "digit_bits": bits,
                           "num_warps": warps or kernel.num_warps_for(space[0].shape[1]), "ids_ok": ok}
                    if name == "default (t0.9 k50 p1)" and device.type == "cuda":
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            for _ in range(draws):
                                kernel.launch(*args, digit_bits=bits, num_warps=warps)
                        graph.replay()
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        for _ in range(replays):
                            graph.replay()
                        end.record()
                        torch.cuda.synchronize()
                        row["graph_us_per_draw"] = round(start.elapsed_time(end) * 1e3 / (replays * draws), 2)
                    out.append(row)
    return out, failures


def code_predictor_loop(device) -> tuple[list[dict], list[str]]:
    from triton.testing import do_bench

    from engine.model.random_model import build_random_model

    t0 = time.monotonic()
    loaded = build_random_model("1.7b", str(device), torch.bfloat16)
    for module in loaded.tts.modules():  # what the loader does once the weights are in
        if hasattr(module, "prepare_inference"):
            module.prepare_inference()
    model, results, failures = loaded.tts, [], []
    print(f"random:1.7b built in {time.monotonic() - t0:.1f} s")
    H = model.cfg.talker.stack.hidden_size
    gen = torch.Generator(device=device).manual_seed(2)
    for B in (1, 64):
        hidden = torch.randn(B, H, generator=gen, device=device, dtype=torch.bfloat16)
        code0 = torch.randint(0, 2048, (B,), generator=gen, device=device)
        frame = torch.arange(B, device=device) + 3
        for mode, t in (("greedy", 0.0), ("sampled", 0.9)):
            rows = SamplerRows(torch.full((B,), t, device=device), torch.full((B,), 50, device=device),
                               torch.ones(B, device=device), torch.arange(B, device=device) + 11)
            loop = partial(frame_codes, model, hidden, code0, rows, frame)

            with torch.inference_mode():
                sampling.FUSED_ON_CUDA = False
                ref_codes = loop()
                ref_ms = do_bench(loop, return_mode="median")
                sampling.FUSED_ON_CUDA = True
                codes = loop()
                eager_ms = do_bench(loop, return_mode="median")
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    loop()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    graph_codes = loop()
                graph.replay()
                graph_equal = bool(torch.equal(graph_codes, codes))
                graph_ms = do_bench(graph.replay, return_mode="median")
            same = int((codes != ref_codes).sum())
            results.append({"B": B, "rows": mode, "reference_eager_ms": round(ref_ms, 3),
                            "kernel_eager_ms": round(eager_ms, 3), "kernel_graph_ms": round(graph_ms, 3),
                            "codes_differ_from_reference": same, "graph_equals_eager": graph_equal})
            if same:
                failures.append(f"Code Predictor B{B} {mode}: {same} of {codes.numel()} codes differ from the "
                                "reference sampler")
            if not graph_equal:
                failures.append(f"Code Predictor B{B} {mode}: graph replay codes differ from eager")
    return results, failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--repeats", type=int, default=8, help="random batches per (dtype, V, B) in the id check")
    ap.add_argument("--skip-model", action="store_true", help="no Code Predictor loop (no 1.7B model build)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this check is for the GPU (the CPU tests run the kernel under TRITON_INTERPRET=1)")
        return 2
    device = torch.device("cuda")
    status = kernel.kernels_status()
    if not status["fused_sampler"]:
        print(f"fused sampler unavailable: {status['reason']}")
        return 1
    t0 = time.monotonic()
    ids, failures = correctness(device, a.repeats)
    times = timings(device)
    variants, variant_failures = graph_timings(device)
    failures += variant_failures
    cp, cp_failures = ([], []) if a.skip_model else code_predictor_loop(device)
    failures += cp_failures
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "kernel": status, "ids": ids,
              "draw_timings": times, "graph_variants": variants,
              "code_predictor": cp, "failures": failures,
              "seconds": round(time.monotonic() - t0, 1)}
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check_sampler.json").write_text(json.dumps(report, indent=1))

    print(f"\n{'dtype':<9}{'V':>6}{'B':>4}  greedy  sampled  top_p   (mismatches / rows)")
    for r in ids:
        print(f"{r['dtype']:<9}{r['V']:>6}{r['B']:>4}  {r['greedy_mismatch']}/{r['greedy_rows']:<5}"
              f"{r['sampled_mismatch']}/{r['sampled_rows']:<6}{r['top_p_mismatch']}/{r['top_p_rows']}")
    print(f"\n{'V':>5}{'B':>4}  {'rows':<22}{'kernel us':>10}{'reference us':>14}")
    for r in times:
        print(f"{r['V']:>5}{r['B']:>4}  {r['rows']:<22}{r['kernel_us']:>10.1f}{r['reference_us']:>14.1f}")
    print(f"\nin a CUDA graph, us per draw (default rows t0.9 k50 p1)\n{'V':>5}{'B':>4}{'scale':>6}"
          + "".join(f"{str(b) + 'b/' + str(w or 'd') + 'w':>9}" for b, w in VARIANTS))
    timed = [r for r in variants if "graph_us_per_draw" in r]
    for i in range(0, len(timed), len(VARIANTS)):
        r = timed[i]
        print(f"{r['V']:>5}{r['B']:>4}{r['scale']:>6}"
              + "".join(f"{v['graph_us_per_draw']:>9.1f}" for v in timed[i : i + len(VARIANTS)]))
    if cp:
        print(f"\nCode Predictor loop (15 codes, random:1.7b bf16)\n{'B':>3}  {'rows':<8}{'ref eager ms':>13}"
              f"{'kernel eager ms':>16}{'kernel graph ms':>16}  codes differ  graph==eager")
        for r in cp:
            print(f"{r['B']:>3}  {r['rows']:<8}{r['reference_eager_ms']:>13.3f}{r['kernel_eager_ms']:>16.3f}"
                  f"{r['kernel_graph_ms']:>16.3f}  {r['codes_differ_from_reference']:>12}  {r['graph_equals_eager']}")
    print("\nFAILURES:\n  " + "\n  ".join(failures) if failures else "\nall correctness checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
