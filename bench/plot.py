"""Latency percentiles against RPS, from one or more reports (loadgen or capacity), as a PNG.

    python -m bench.plot report1.json report2.json [--baseline baseline.json] --out plot.png

p50 / p95 / p99 of audible TTFA (solid) and first playable (dashed) per workload, on a log scale, with the SLO
line (p95 audible TTFA 50 ms). A percentile that is +inf (too many failed requests) is drawn as a triangle at the
top edge. With --baseline, the official package's p50 first audio (the whole utterance) is a grey line.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict


def collect(reports: list[dict]) -> dict[str, list[dict]]:
    """Points by workload, one per rate (a later report's point replaces an earlier one at the same rate)."""
    by: dict[str, dict[float, dict]] = defaultdict(dict)
    for r in reports:
        for p in r.get("points", []):
            c = p["config"]
            if "workload" in c and "rps" in c:
                by[c["workload"]][float(c["rps"])] = p
    return {w: [pts[k] for k in sorted(pts)] for w, pts in by.items()}


def plot(reports: list[dict], out: str, baseline: dict | None = None, title: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = collect(reports)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    colors = {"p50": "tab:green", "p95": "tab:orange", "p99": "tab:red"}
    finite = []
    for pts in series.values():
        for p in pts:
            for key in ("audible_ttfa_ms", "first_playable_ms"):
                finite += [v for q, v in p["summary"]["latency_ms"][key].items()
                           if q in colors and isinstance(v, float) and math.isfinite(v) and v > 0]
    top = max(finite + [100.0]) * 2
    bottom = max(min(finite + [50.0]) / 2, 0.1)
    markers = ["o", "s", "D", "^"]
    for wi, (w, pts) in enumerate(sorted(series.items())):
        x = [p["config"]["rps"] for p in pts]
        for key, style, label in (("audible_ttfa_ms", "-", "audible TTFA"), ("first_playable_ms", "--",
                                                                              "first playable")):
            for q, col in colors.items():
                y = [p["summary"]["latency_ms"][key][q] for p in pts]
                yy = [v if math.isfinite(v) else math.nan for v in y]
                ax.plot(x, yy, style, color=col, marker=markers[wi % len(markers)], ms=4,
                        label=f"{w} {label} {q}")
                inf_x = [xi for xi, v in zip(x, y, strict=True) if math.isinf(v)]
                if inf_x:
                    ax.plot(inf_x, [top / 1.15] * len(inf_x), "^", color=col, ms=8)
    if baseline is not None:
        b = baseline["points"][0]["summary"]["latency_ms"]["first_playable_ms"]["p50"]
        if math.isfinite(b):
            ax.axhline(b, color="grey", lw=1.5, label=f"official qwen-tts first audio p50 ({b / 1e3:.1f} s)")
            top = max(top, b * 2)
    ax.axhline(50, color="black", lw=1, ls=":", label="SLO: p95 audible TTFA 50 ms")
    ax.set_yscale("log")
    ax.set_ylim(bottom, top)
    ax.set_xlabel("offered load (requests per second, Poisson)")
    ax.set_ylabel("latency (ms)")
    if title is None and reports:
        r = reports[0]
        gpu = (r.get("gpu") or [{}])[0].get("name", "no GPU") if r.get("gpu") else "no GPU"
        title = f"voicelane, {gpu}, commit {str(r.get('commit'))[:10]}"
    ax.set_title(title or "voicelane")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.report import load_report

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--baseline", default=None)
    ap.add_argument("--title", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    reports = [load_report(p) for p in args.reports]
    baseline = load_report(args.baseline) if args.baseline else None
    print(plot(reports, args.out, baseline, args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
