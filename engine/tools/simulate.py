"""Predict TTFA, underruns and step times of a scheduling policy in seconds on a CPU (no torch, no GPU).

    python -m engine.tools.simulate --rps 1 10 20 --duration 60 --mode whole
    python -m engine.tools.simulate --profile stages.json --rps 10 --mode streamed --silent-frames 2 --out sim.json

The real Scheduler and EngineCore run on a simulated device whose step times come from a stage profile
(engine/tools/profile_stages.py's JSON; default: the H200 profile in docs/benchmarks/h200/). These are
predictions of a model: put them beside a measurement, never in its place (docs/engine.md, "The simulator").
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace

from engine.config import MAX_SLOTS, EngineConfig, SchedulerConfig
from engine.sim.profile import DEFAULT_PROFILE, StageProfile
from engine.sim.run import SimOptions, simulate
from engine.sim.workload import poisson_workload


def scheduler_config(args) -> SchedulerConfig:
    cfg = SchedulerConfig(max_slots=args.max_slots)
    overrides = {"max_step_s": args.max_step_ms / 1e3}
    if args.chunk_ramp is not None:
        overrides["chunk_ramp"] = tuple(args.chunk_ramp)
    if args.plan_lead_ms is not None:
        overrides["plan_lead_s"] = args.plan_lead_ms / 1e3
    if args.policy is not None:
        overrides["policy"] = args.policy
    if args.first_audio_lane:
        overrides["first_audio_lane"] = True
    if args.first_audio_chain is not None:
        overrides["first_audio_chain"] = args.first_audio_chain == "on"
    if args.codec_chunks is not None:
        overrides["mix_codec_chunks"] = args.codec_chunks == "mixed"
    if args.collect_first_audio_at_once is not None:
        overrides["collect_first_audio_at_once"] = args.collect_first_audio_at_once == "on"
    if args.pace_buffer_ms is not None:
        overrides["pace_buffer_s"] = args.pace_buffer_ms / 1e3
    if args.pace_max_contexts is not None:
        overrides["pace_max_contexts"] = args.pace_max_contexts
    return replace(cfg, **overrides)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=str(DEFAULT_PROFILE), help="profile_stages JSON")
    ap.add_argument("--graphs", default="on", help="which rows of the profile: graphs on or off")
    ap.add_argument("--rps", type=float, nargs="+", default=[1.0, 10.0, 20.0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=["whole", "streamed"], default="whole")
    ap.add_argument("--silent-frames", type=int, default=0, help="leading silent frames per segment (real weights)")
    ap.add_argument("--word-interval-ms", type=float, default=10.0, help="streamed: ms between words")
    ap.add_argument("--ack-interval-ms", type=float, default=0.0, help="playback acks every N ms (0: none)")
    ap.add_argument("--host-step-ms", type=float, default=0.3, help="host time of one engine iteration")
    ap.add_argument("--max-slots", type=int, default=MAX_SLOTS, help="slots (the engine's auto on an H200: 128)")
    ap.add_argument("--prefix-cache-entries", type=int, default=EngineConfig.prefix_cache_entries,
                    help="the engine's prompt-prefix cache (0: off, every prefill runs its whole prompt)")
    ap.add_argument("--max-step-ms", type=float, default=20.0)
    ap.add_argument("--policy", default=None, help="SchedulerConfig.policy: first_audio or edf (default: the "
                    "configured one)")
    ap.add_argument("--chunk-ramp", type=int, nargs="+", default=None, help="codec frames per chunk (default: "
                    "the configured ramp)")
    ap.add_argument("--plan-lead-ms", type=float, default=None, help="plan the next step this long before the "
                    "running one ends (0: at once, the device queue two deep; default: the configured one)")
    ap.add_argument("--first-audio-lane", action="store_true", help="two lanes: newcomers on a stream of their own")
    ap.add_argument("--first-audio-chain", choices=["on", "off"], default=None, help="a segment's prefill, frame "
                    "0's codes and its first 1-frame chunk as one step (default: the configured one)")
    ap.add_argument("--collect-first-audio-at-once", choices=["on", "off"], default=None, help="collect a step "
                    "that makes first audio before launching the next (default: the configured one)")
    ap.add_argument("--lane-slowdown", type=float, default=1.0, help="two lanes: a step overlapping the other "
                    "lane's work takes this much longer (1: no contention)")
    ap.add_argument("--codec-chunks", choices=["mixed", "uniform"], default=None, help="a codec step's rows: every "
                    "chunk up to its anchor's (mixed, the default) or the anchor's chunk size only")
    ap.add_argument("--no-onset", dest="reports_onset", action="store_false", help="the consumer reports no "
                    "audible onset: the first-audio class ends at the first chunk even when it is silent")
    ap.add_argument("--pace-buffer-ms", type=float, default=None, help="pacing: a playing stream with this much "
                    "audio buffered waits at light load (0: off; default: the configured one)")
    ap.add_argument("--pace-max-contexts", type=int, default=None, help="pacing: at most this many contexts open "
                    "(0: half the slots; default: the configured one)")
    ap.add_argument("--out", default=None, help="write the summaries as JSON here")
    a = ap.parse_args(argv)
    profile = StageProfile.from_json(a.profile, a.graphs)
    cfg = scheduler_config(a)
    options = SimOptions(host_step_s=a.host_step_ms / 1e3, word_interval_s=a.word_interval_ms / 1e3,
                         ack_interval_s=a.ack_interval_ms / 1e3, prefix_cache_entries=a.prefix_cache_entries,
                         lane_slowdown=a.lane_slowdown, reports_onset=a.reports_onset)
    results = {}
    lanes = f", first-audio lane (slowdown {a.lane_slowdown:g})" if cfg.first_audio_lane else ""
    lanes += ", first-audio chain" if cfg.first_audio_chain else ""
    print(f"simulated (profile {a.profile}, policy {cfg.policy}, plan lead {cfg.plan_lead_s * 1e3:g} ms{lanes}, "
          f"{a.mode}, {a.duration:g} s)")
    print(f"{'rps':>5} {'offered':>7} {'refused':>7} {'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} {'underrun':>8} "
          f"{'busy':>5} {'wall s':>6}")
    for rps in a.rps:
        t0 = time.monotonic()
        report = simulate(cfg, profile, poisson_workload(rps, a.duration, a.seed, a.mode, a.silent_frames), options)
        s = report.summary()
        results[str(rps)] = s
        t = s["ttfa_ms"]
        print(f"{rps:>5g} {s['requests']:>7} {s['refused']:>7} {t['p50']:>7.1f} {t['p95']:>7.1f} {t['p99']:>7.1f} "
              f"{s['underrun_requests']:>8} {s['gpu_busy']:>5.2f} {time.monotonic() - t0:>6.1f}")
        steps = [f"{k} {v['steps']}x{v['mean_rows']:g} {v['mean_ms']:.1f}/{v['p95_ms']:.1f}"
                 for k, v in s["stages"].items()]
        print("      steps (count x mean rows, mean / p95 ms): " + ", ".join(steps))
        cache = s["prefix_cache"]
        print(f"      prefix cache: {cache['hits']} hits, {cache['misses']} misses")
    out = {"profile": a.profile, "mode": a.mode, "duration_s": a.duration, "seed": a.seed,
           "scheduler": {k: v for k, v in asdict(cfg).items()}, "options": asdict(options), "results": results}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
