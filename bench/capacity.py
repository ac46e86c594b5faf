"""Capacity at SLO: the highest RPS at which p95 audible TTFA <= 50 ms, zero underrun requests and zero errors.

    python -m bench.capacity --url http://127.0.0.1:8000 --workload w1 --start 10 --max-rps 200 \\
        --warmup 15 --window 60 --seed 0 --state capacity.json --budget 540 [--server-cmd "..."]

Search: start at --start; while a point passes, multiply the rate by --factor (up to --max-rps); once a point
fails, bisect between the highest passing rate and the lowest failing rate above it until they are closer than
--resolution (relative) or --min-step (absolute). If the first point fails, the rate is divided by --factor
until one passes (or --min-rps is reached: capacity 0).

One command may run at most 10 minutes on the GPU machine, so the search is resumable: every point is appended
to --state (which is the capacity report), and a command only starts a point that fits in what is left of
--budget seconds (estimated as warm-up + window + the longest drain seen so far). Run the same command again to
continue. Exit status 0: the search is finished; 75: more points are needed (run the command again).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.loadgen import (
    add_common_args,
    config_from_args,
    describe_server,
    point_line,
    run_loop,
    run_point,
    server_context,
)
from bench.report import environment, load_report, write_report

EXIT_MORE = 75


def next_rate(passed: list[float], failed: list[float], start: float, factor: float, max_rps: float,
              min_rps: float, resolution: float, min_step: float) -> float | None:
    """The next rate to measure, or None when the search is finished."""
    lo = max(passed) if passed else None
    above = [f for f in failed if lo is None or f > lo]
    hi = min(above) if above else None
    if lo is None and hi is None:
        return start
    if hi is None:  # everything measured so far passed: go up
        if lo >= max_rps:
            return None
        return min(lo * factor, max_rps)
    if lo is None:  # everything failed: go down
        r = hi / factor
        return r if r >= min_rps else None
    if hi - lo <= max(resolution * lo, min_step):
        return None
    mid = _round((lo + hi) / 2, min_step)
    return mid if lo < mid < hi else None


def _round(r: float, step: float) -> float:
    if step <= 0:
        return r
    return max(step, round(r / step) * step)


def capacity_of(points: list[dict]) -> float:
    passed = [p["config"]["rps"] for p in points if p["summary"]["slo"]["pass"]]
    return max(passed) if passed else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--start", type=float, default=10.0, help="first rate")
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--max-rps", type=float, default=400.0)
    ap.add_argument("--min-rps", type=float, default=0.25)
    ap.add_argument("--resolution", type=float, default=0.1, help="stop when hi - lo <= resolution * lo ...")
    ap.add_argument("--min-step", type=float, default=1.0, help="... or <= this many RPS; also the rounding step")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds this command may spend on points")
    ap.add_argument("--state", required=True, help="the capacity report, read and extended")
    args = ap.parse_args(argv)
    t_begin = time.monotonic()

    state_path = Path(args.state)
    if state_path.exists():
        report = load_report(state_path)
    else:
        report = {"kind": "capacity", "points": [], "invocations": []}
    env = environment("bench.capacity")
    if report.get("commit") and env["commit"] != report["commit"]:
        print(f"warning: the state was measured at commit {report['commit']}, this is {env['commit']}",
              file=sys.stderr)
    report.update({k: v for k, v in env.items() if k != "created"})
    report.setdefault("created", env["created"])
    report["invocations"].append({"created": env["created"], "command": env["command"]})
    report["search"] = {k: getattr(args, k) for k in ("workload", "start", "factor", "max_rps", "min_rps",
                                                      "resolution", "min_step", "warmup", "window", "seed")}
    report["slo"] = {"p95_audible_ttfa_ms": args.slo_ttfa_ms, "underrun_requests": 0, "errors": 0}

    def rates():
        pts = [p for p in report["points"] if p["config"]["workload"] == args.workload]
        passed = [p["config"]["rps"] for p in pts if p["summary"]["slo"]["pass"]]
        failed = [p["config"]["rps"] for p in pts if not p["summary"]["slo"]["pass"]]
        return next_rate(passed, failed, args.start, args.factor, args.max_rps, args.min_rps, args.resolution,
                         args.min_step)

    longest = [max((p.get("duration_s", 0.0) for p in report["points"]), default=0.0)]
    with server_context(args) as srv:

        async def go():
            report["server"], fpw = await describe_server(args, srv)
            while True:
                rate = rates()
                if rate is None:
                    return True
                estimate = max(longest[0], args.warmup + args.window + 5)
                if time.monotonic() - t_begin + estimate > args.budget:
                    return False
                t0 = time.monotonic()
                p = await run_point(config_from_args(args, rate), fpw)
                p["duration_s"] = time.monotonic() - t0
                longest[0] = max(longest[0], p["duration_s"])
                report["points"].append(p)
                print(point_line(p), file=sys.stderr)
                report["capacity_rps"] = capacity_of([q for q in report["points"]
                                                      if q["config"]["workload"] == args.workload])
                write_report(report, state_path)

        done = run_loop(go())
    pts = [q for q in report["points"] if q["config"]["workload"] == args.workload]
    report["capacity_rps"] = capacity_of(pts)
    report["done"] = bool(done)
    write_report(report, state_path)
    tried = ", ".join(f"{q['config']['rps']:g}{'+' if q['summary']['slo']['pass'] else '-'}"
                      for q in sorted(pts, key=lambda q: q["config"]["rps"]))
    status = "finished" if done else "not finished: run the same command again"
    print(f"capacity at SLO ({args.workload}): {report['capacity_rps']:g} RPS; points {tried}; {status}",
          file=sys.stderr)
    return 0 if done else EXIT_MORE


if __name__ == "__main__":
    raise SystemExit(main())

