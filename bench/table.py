"""A markdown table of the points in one or more reports (what docs/benchmarks/README.md shows).

    python -m bench.table report1.json report2.json capacity.json [--baseline baseline.json]
"""

from __future__ import annotations

import argparse
import math

from bench.plot import collect
from bench.report import fmt_ms, load_report

HEADER = ("| workload | RPS | audible TTFA p50 / p95 / p99 (ms) | first playable p50 / p95 / p99 (ms) | "
          "E2E p50 / p95 (ms) | underrun req. | stall (ms) | errors | peak in flight | achieved RPS | SLO |")
RULE = "|---|---|---|---|---|---|---|---|---|---|---|"


def _three(d: dict, qs=("p50", "p95", "p99")) -> str:
    return " / ".join(fmt_ms(d[q]) for q in qs)


def rows(reports: list[dict]) -> list[str]:
    out = []
    for w, pts in sorted(collect(reports).items()):
        for p in pts:
            s, lat = p["summary"], p["summary"]["latency_ms"]
            out.append(f"| {w.upper()} | {p['config']['rps']:g} | {_three(lat['audible_ttfa_ms'])} | "
                       f"{_three(lat['first_playable_ms'])} | {_three(lat['e2e_ms'], ('p50', 'p95'))} | "
                       f"{s['underrun_requests']} / {s['offered']} | {s['total_stall_ms']:.0f} | {s['errors']} | "
                       f"{s.get('peak_in_flight', '-')} | {s['achieved_rps']:.2f} | "
                       f"{'pass' if s['slo']['pass'] else 'fail'} |")
    return out


def markdown(reports: list[dict], baseline: dict | None = None) -> str:
    lines = [HEADER, RULE, *rows(reports)]
    caps = [r for r in reports if r.get("kind") == "capacity"]
    for r in caps:
        lines.append("")
        lines.append(f"Capacity at SLO ({r['search']['workload'].upper()}): **{r['capacity_rps']:g} RPS**"
                     f"{'' if r.get('done') else ' (search not finished)'}.")
    if baseline is not None:
        s = baseline["points"][0]["summary"]
        fp = s["latency_ms"]["first_playable_ms"]
        mpf = s.get("ms_per_frame", {}).get("p50", math.nan)
        lines.append("")
        lines.append(f"Official qwen-tts (closed loop, one request at a time, {s['offered']} requests): first audio "
                     f"p50 / p95 {fmt_ms(fp['p50'])} / {fmt_ms(fp['p95'])} ms (the whole utterance), "
                     f"{fmt_ms(mpf)} ms per frame, RTF {s.get('rtf', {}).get('p50', math.nan):.2f}.")
        ratios = []
        for r in reports:
            for p in r.get("points", []):
                v = p.get("vs_official")
                if v:
                    ratios.append(f"{p['config']['workload'].upper()} {p['config']['rps']:g} RPS: audible TTFA p50 "
                                  f"ours/official {v['audible_ttfa_ms_p50_ratio']:.4f}")
        if ratios:
            lines.append("")
            lines.extend(f"- {x}" for x in ratios)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--baseline", default=None)
    args = ap.parse_args(argv)
    print(markdown([load_report(p) for p in args.reports], load_report(args.baseline) if args.baseline else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
