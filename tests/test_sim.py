"""The scheduler simulator's mechanics: profile costs, the one-step-late contract, the listener model, the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.sim.profile import DEFAULT_PROFILE, StageProfile
from engine.sim.run import Listener, SimOptions, Simulation, simulate
from engine.sim.workload import Arrival, poisson_workload, word_ids
from engine.types import AudioChunk, Stage
from tests.test_scheduler import three_steps

ROOT = Path(__file__).resolve().parents[1]
# Pinned here, not read from docs/benchmarks/: a new H200 profile there must not silently move these bounds.
H200_PROFILE = ROOT / "tests/data/h200_stages.json"
H200 = StageProfile.from_json(H200_PROFILE)
PINNED_SOURCE = ROOT / "docs/benchmarks/h200/stages_1p7b_after.json"  # what H200_PROFILE was cut from
HOST = 0.0003


def ms(stage, batch=1, chunk=0):
    return H200.step_s(stage, batch, chunk)


def test_profile_reads_measured_rows_and_interpolates_between_them():
    rows = json.loads(H200_PROFILE.read_text())["rows"]
    measured = {(r["stage"], r["batch"], r.get("chunk", 0)): r["ms"] / 1e3 for r in rows
                if r.get("prompt_len", 16) == 16}
    for (stage, batch, chunk), seconds in measured.items():
        assert H200.step_s(Stage(stage), batch, chunk) == pytest.approx(seconds)
    # a batch is padded to its graph bucket: 5 rows cost what 8 do
    assert H200.step_s(Stage.TALKER, 5) == pytest.approx(measured[("talker", 8, 0)])
    # 16 rows (bucket 16) lie on the line between the measured 8 and 64
    t8, t64 = measured[("talker", 8, 0)], measured[("talker", 64, 0)]
    assert H200.step_s(Stage.TALKER, 16) == pytest.approx(t8 + (t64 - t8) * 8 / 56)
    # a codec chunk of 4 frames lies between the measured 1 and 12 at the same batch
    c1, c12 = measured[("codec", 8, 1)], measured[("codec", 8, 12)]
    assert H200.step_s(Stage.CODEC, 8, 4) == pytest.approx(c1 + (c12 - c1) * 3 / 11)
    # the 64-token prefill rows (eager in that run) are not used unless asked for
    assert H200.step_s(Stage.PREFILL, 1) == pytest.approx(measured[("prefill", 1, 0)])
    long = StageProfile.from_json(PINNED_SOURCE, prompt_len=64)
    assert long.step_s(Stage.PREFILL, 1) > 0.05


def test_pinned_profile_is_the_measured_h200_profile_and_as_asymmetric():
    """The test profile is docs/benchmarks/h200/stages_1p7b_after.json's graph rows, and it keeps the asymmetry
    the policy tests depend on: the Code Predictor is the long per-frame stage, the codec spans a 15x range."""
    assert StageProfile.from_json(PINNED_SOURCE).tables == H200.tables
    assert 0.005 < ms(Stage.PREFILL, 1) < ms(Stage.PREFILL, 8) < 0.009
    assert 0.006 < ms(Stage.TALKER, 1) < ms(Stage.TALKER, 64) < 0.0115
    assert 0.0145 < ms(Stage.CODE_PREDICTOR, 1) < 0.016 and 0.0145 < ms(Stage.CODE_PREDICTOR, 64) < 0.016
    assert ms(Stage.CODEC, 1, 1) == pytest.approx(0.0036, abs=1e-4)
    assert ms(Stage.CODEC, 64, 12) == pytest.approx(0.056, abs=1e-3)


def test_the_cli_default_profile_has_every_stage_the_simulator_reads_measured():
    """The default (what `simulate` predicts from when not told) holds measured FIRST_AUDIO rows and 1-position
    prefills after a cached prefix, so it prices neither from a stand-in."""
    default = StageProfile.from_json(DEFAULT_PROFILE)
    assert set(default.tables) == set(Stage)
    assert 1 in default.tables[Stage.PREFILL]
    assert default.tables[Stage.FIRST_AUDIO][0][0][0] == 1


def one(text="Hello there, my friend.", at=0.0, mode="whole", silent=0, index=0):
    return Arrival(index, at, word_ids(text), mode, silent)


def test_an_idle_engine_gives_first_audio_after_exactly_the_first_audio_chain():
    """Prefill, Code Predictor and the first 1-frame codec chunk run back to back: the host plans each next step
    while the one before runs (the Code Predictor needs no result of the prefill, the codec needs its EOS flag,
    which is collected while the Code Predictor runs)."""
    chain = HOST + ms(Stage.PREFILL) + ms(Stage.CODE_PREDICTOR) + ms(Stage.CODEC, 1, 1)
    for mode in ("whole", "streamed"):
        report = simulate(three_steps(), H200, [one(mode=mode)])
        (listener,) = report.listeners
        assert listener.ttfa_s == pytest.approx(chain)
        assert listener.done_at is not None and listener.underruns == 0
        assert listener.received_s == pytest.approx(4 * 5 * 0.08)  # 4 words x 5 frames of 80 ms


def newcomer_prefill_and_steps_before(cfg, at=0.2):
    sim = Simulation(cfg, H200, [one("a " * 30), one(at=at, index=1)])
    steps = sim.run().steps
    prefill_2 = [s for s in steps if s[0] == Stage.PREFILL][1]
    return prefill_2, [s for s in steps if s[3] < prefill_2[3]]


def test_planned_at_once_a_newcomer_waits_for_the_step_in_flight_and_the_one_already_queued():
    """plan_lead_s = 0: the core launches step i before collecting step i-1, so when a request arrives while the
    host waits for step i-1, step i is already queued, and the newcomer's prefill runs after both."""
    prefill_2, before = newcomer_prefill_and_steps_before(three_steps(plan_lead_s=0.0))
    running = next(s for s in before if s[3] <= 0.2 < s[3] + s[4])
    queued = before[before.index(running) + 1]
    assert queued[3] == pytest.approx(running[3] + running[4])  # queued at once, behind the running step
    assert prefill_2[3] == pytest.approx(queued[3] + queued[4])  # the newcomer's prefill: right after it
    assert before[-1] is queued


@pytest.mark.parametrize("at", [0.2, 0.2071, 0.2133, 0.25])
def test_planned_late_a_newcomer_waits_for_the_running_step_only(at):
    """plan_lead_s > 0: the next step is planned plan_lead_s before the running one ends, so a newcomer that
    arrives before that point is in it: its prefill starts when the running step ends, and the device never
    idles between steps (the lead covers the host's planning)."""
    lead = 0.005
    prefill_2, before = newcomer_prefill_and_steps_before(three_steps(plan_lead_s=lead), at)
    running = next(s for s in before if s[3] <= at < s[3] + s[4])
    if at < running[3] + running[4] - lead:
        assert before[-1] is running and prefill_2[3] == pytest.approx(running[3] + running[4])
    else:  # arrived inside the lead: the step after was already planned, one more step at most
        assert len(before) - before.index(running) <= 2
    for a, b in zip(before, before[1:] + [prefill_2], strict=False):
        assert b[3] == pytest.approx(a[3] + a[4])  # back to back: late planning costs no device time


def test_listener_drops_leading_silence_and_counts_late_packets_as_underruns():
    x = Listener(one())

    def packet(t, first, frames):
        x.packet(t, AudioChunk(pcm=np.zeros(frames * 1920, np.float32), start_sample=0, segment=0, first_frame=first,
                               codes=np.zeros((frames, 16)), cid=1), silent_frames=2)

    packet(0.010, 0, 1)  # silent: dropped, not the start of playback
    packet(0.020, 1, 1)  # silent
    assert x.first_audible_at is None and x.dropped_s == pytest.approx(0.16)
    packet(0.030, 2, 1)  # audible: playback starts, plays until 0.110
    packet(0.100, 3, 2)  # in time: plays 0.110 .. 0.270
    packet(0.300, 5, 1)  # 30 ms late
    assert x.ttfa_s == pytest.approx(0.030)
    assert x.underruns == 1 and x.stall_s == pytest.approx(0.030)
    played, state, buffered = x.report(0.340)
    assert state == "playing" and buffered == pytest.approx(40.0) and played == pytest.approx(160 + 320 - 40)


def test_silent_leading_frames_delay_audible_first_audio_by_their_chunks():
    quiet = simulate(three_steps(), H200, [one(silent=3)]).listeners[0]
    loud = simulate(three_steps(), H200, [one(silent=0)]).listeners[0]
    assert quiet.ttfa_s > loud.ttfa_s + ms(Stage.TALKER) + ms(Stage.CODE_PREDICTOR)  # at least 1 more frame
    assert quiet.dropped_s == pytest.approx(3 * 0.08)
    assert quiet.first_packet_at == loud.first_packet_at


def test_refused_requests_count_as_infinite_first_audio():
    cfg = three_steps(max_slots=1)
    report = simulate(cfg, H200, [one(), one(at=0.001, index=1)])
    s = report.summary()
    assert s["refused"] == 1 and math.isinf(s["ttfa_ms"]["p95"])
    assert report.listeners[1].refused and "slots" in report.listeners[1].refused


def test_poisson_workload_speaks_the_benchmark_sequence():
    from bench.prompts import prompt_sequence

    arrivals = poisson_workload(5, 20, seed=3, mode="streamed")
    assert 50 < len(arrivals) < 150
    assert all(b.at > a.at for a, b in zip(arrivals, arrivals[1:], strict=False))
    sentences = prompt_sequence(3, len(arrivals))
    assert [a.word_count for a in arrivals] == [len(s.split()) for s in sentences]
    assert arrivals == poisson_workload(5, 20, seed=3, mode="streamed")


def test_streamed_words_arriving_slowly_pace_the_frames():
    """Dual layout reads one text token per frame: words every 300 ms starve the stream between them, so the
    audio ends after the last word, not at the GPU's pace."""
    arrival = one("one two three four five six", mode="streamed")
    fast = simulate(three_steps(), H200, [arrival], SimOptions(word_interval_s=0.01)).listeners[0]
    slow = simulate(three_steps(), H200, [arrival], SimOptions(word_interval_s=0.3)).listeners[0]
    assert fast.done_at < 1.0 < 1.5 < slow.done_at


def test_acks_reach_the_scheduler():
    sim = Simulation(three_steps(), H200, [one("a " * 20)], SimOptions(ack_interval_s=0.05))
    seen = []
    original = sim.scheduler.playback
    sim.scheduler.playback = lambda *a: (seen.append(a), original(*a))[1]
    sim.run()
    assert len(seen) > 5 and all(state in ("playing", "underrun") for _, _, state, _, _ in seen)


def test_simulator_and_scheduler_import_without_torch():
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch' or name.startswith('torch.'):\n"
            "            raise ImportError('torch is blocked')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import engine.sim.run, engine.tools.simulate, engine.scheduler, engine.core\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_cli_prints_a_table_and_writes_json(tmp_path, capsys):
    from engine.tools.simulate import main

    out = tmp_path / "sim.json"
    main(["--rps", "2", "--duration", "5", "--profile", str(H200_PROFILE), "--out", str(out)])
    data = json.loads(out.read_text())
    result = data["results"]["2.0"]
    assert result["requests"] > 0 and result["ttfa_ms"]["p50"] > 0
    printed = capsys.readouterr().out
    assert "simulated" in printed and "p99 ms" in printed and "underrun" in printed
    assert "code_predictor" in printed and "codec" in printed  # step times per stage
    assert set(result["ttfa_ms"]) >= {"p50", "p95", "p99"} and result["stages"]["codec"]["mean_ms"] > 0
    assert data["scheduler"]["max_slots"] == 128 and data["mode"] == "whole"
    assert "prefix cache: " in printed and result["prefix_cache"]["misses"] == 1  # one voice: one prefix


# ---------------------------------------------------------------------- policy under realistic asymmetric costs
RAMPING = [one(" ".join(["word"] * 20), index=i) for i in range(8)]  # 8 streams start together, 100 frames each
CHAIN = HOST + ms(Stage.PREFILL) + ms(Stage.CODE_PREDICTOR) + ms(Stage.CODEC, 1, 1)  # 25.3 ms on this profile
# A newcomer may wait for one short step (max_step_s, 20 ms) plus the plan lead, besides its own chain: 50.3 ms.
NEWCOMER_BOUND_S = CHAIN + 0.020 + 0.005


def test_a_newcomer_reaches_first_audio_within_its_chain_plus_one_short_step_while_others_ramp(cfg=None):
    """8 streams start at t = 0 (first audio at 27.7 ms) and ramp; a ninth request arrives at every 10 ms from
    30 to 400 ms. Its first audio must come within its own chain plus one short step. (Before 30 ms it queues
    behind the eight's chains, first come first served, by design.) The edf policy with the 1,2,4,8,12 ramp and
    the two-deep device queue, before issue 13, gave up to 166 ms here: ramping streams outranked it."""
    worst = 0.0
    for k in range(3, 41):
        report = simulate(cfg or three_steps(), H200, RAMPING + [one(at=k * 0.01, index=8)])
        newcomer = report.listeners[-1]
        worst = max(worst, newcomer.ttfa_s)
        assert all(x.underruns == 0 and x.done_at is not None for x in report.listeners)
    assert worst <= NEWCOMER_BOUND_S, f"worst newcomer first audio {worst * 1e3:.1f} ms"


def test_zero_underruns_and_no_refusals_at_10_rps():
    """Whole-text Poisson arrivals at 10 RPS for 20 s (about 35 concurrent streams) on the H200 profile."""
    s = simulate(three_steps(), H200, poisson_workload(10, 20, seed=1, mode="whole")).summary()
    assert s["requests"] > 150 and s["refused"] == 0 and s["unfinished"] == 0
    assert s["underrun_requests"] == 0 and s["stall_ms"] == 0
    assert s["ttfa_ms"]["p95"] <= 80.0  # simulator's 62 ms on this seed; the old policy's 182 ms


# ---------------------------------------------------------------------- the prompt-prefix cache (issue 13 item 5)
def test_a_prefill_of_fewer_positions_costs_less_down_to_a_talker_step():
    """Without a measured 1-position prefill, one position costs the Talker step at that batch (never more than
    the shortest measured prefill); lengths in between are interpolated; a whole prompt (0) costs the profile's
    prompt length, and longer ones no more."""
    for batch in (1, 8, 64):
        p16 = ms(Stage.PREFILL, batch)
        one_position = min(ms(Stage.TALKER, batch), p16)
        assert ms(Stage.PREFILL, batch, 1) == pytest.approx(one_position)
        assert ms(Stage.PREFILL, batch, 8) == pytest.approx(one_position + (p16 - one_position) * 7 / 15)
        assert ms(Stage.PREFILL, batch, 16) == ms(Stage.PREFILL, batch, 64) == p16
    assert ms(Stage.PREFILL, 64, 1) < ms(Stage.PREFILL, 64) / 3  # 11.1 ms against 34.7 on this profile


def test_a_measured_short_prefill_replaces_the_stand_in(tmp_path):
    rows = json.loads(H200_PROFILE.read_text())["rows"]
    rows += [{"stage": "prefill", "batch": b, "prompt_len": 1, "cached_prefix": 9, "ms": 1.5} for b in (1, 8, 64)]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"rows": rows}))
    profile = StageProfile.from_json(path)
    assert profile.prompt_len == 16  # whole prompts: the rows without a cached prefix
    assert profile.step_s(Stage.PREFILL, 8, 1) == pytest.approx(0.0015)
    assert profile.step_s(Stage.PREFILL, 8) == pytest.approx(ms(Stage.PREFILL, 8))


def test_cached_prefixes_shorten_the_simulated_prefills():
    """Streamed (dual-layout) arrivals: after the first, every prompt's prefix is cached (one voice), so each
    prefill runs one position; with the cache off each runs the whole prompt."""
    arrivals = poisson_workload(20, 5, seed=2, mode="streamed")
    on = simulate(three_steps(), H200, arrivals)
    off = simulate(three_steps(), H200, arrivals, SimOptions(prefix_cache_entries=0))
    prefill = [(rows, s) for stage, rows, _, _, s in on.steps if stage == Stage.PREFILL]
    assert on.extra["prefix_cache"] == {"hits": sum(rows for rows, _ in prefill) - 1, "misses": 1}
    assert off.extra["prefix_cache"] == {"hits": 0, "misses": 0}
    assert prefill[0][1] == pytest.approx(ms(Stage.PREFILL, prefill[0][0]))  # the miss: the whole prompt
    assert all(s == pytest.approx(ms(Stage.PREFILL, rows, 1)) for rows, s in prefill[1:])
    assert on.summary()["prefix_cache"]["hits"] > 0


# ---------------------------------------------------------------------- the first-audio chain (issue 13 item 3)
def test_the_chain_costs_its_measured_rows_or_its_three_parts():
    """Without first_audio rows a chained step costs its three stages (the prefill at the positions it runs);
    measured rows (profile_stages --stages first_audio) replace that sum."""
    for batch in (1, 8):
        parts = ms(Stage.PREFILL, batch, 1) + ms(Stage.CODE_PREDICTOR, batch) + ms(Stage.CODEC, batch, 1)
        assert ms(Stage.FIRST_AUDIO, batch, 1) == pytest.approx(parts)
    profile = StageProfile(str(H200_PROFILE), {**H200.tables, Stage.FIRST_AUDIO: {1: [(1.0, 0.005), (8.0, 0.006)]}})
    assert profile.step_s(Stage.FIRST_AUDIO, 1, 1) == pytest.approx(0.005)
    assert profile.step_s(Stage.FIRST_AUDIO, 3, 1) == pytest.approx(0.005 + 0.001 * 3 / 7)  # bucket 4


def test_an_idle_engine_gives_first_audio_after_one_chained_step():
    """The chain on an idle engine: one host iteration and the chained step, nothing between its parts."""
    cfg = three_steps(first_audio_chain=True)
    report = simulate(cfg, H200, [one(mode="streamed")])
    (listener,) = report.listeners
    assert listener.ttfa_s == pytest.approx(HOST + ms(Stage.FIRST_AUDIO, 1, 1))
    assert listener.done_at is not None and listener.underruns == 0
    assert [s[0] for s in report.steps][:2] == [Stage.FIRST_AUDIO, Stage.TALKER]


def faster(profile: StageProfile, factor: float) -> StageProfile:
    """The profile with every step `factor` times as long (today's kernels: the pinned profile is an older one)."""
    tables = {stage: {chunk: [(b, t * factor) for b, t in points] for chunk, points in by_chunk.items()}
              for stage, by_chunk in profile.tables.items()}
    return StageProfile(profile.source, tables, profile.pad_to_buckets, profile.prompt_len)


def test_the_chain_keeps_newcomers_bounded_and_zero_underruns_under_load():
    """On the pinned profile's costs at 0.3x (a 7.4 ms chain, as today's H200 kernels have it) the chain runs every
    segment's start, with the policy's two load tests: a newcomer within its chain plus one short step while eight
    streams ramp, and 10 RPS without an underrun or a refusal."""
    fast = faster(H200, 0.3)
    cfg = three_steps(first_audio_chain=True)
    worst = 0.0
    for k in range(3, 41):
        report = simulate(cfg, fast, RAMPING + [one(at=k * 0.01, index=8)])
        worst = max(worst, report.listeners[-1].ttfa_s)
        assert all(x.underruns == 0 and x.done_at is not None for x in report.listeners)
    assert worst <= HOST + fast.step_s(Stage.FIRST_AUDIO, 1, 1) + 0.020 + 0.005, f"{worst * 1e3:.1f} ms"
    summary = simulate(cfg, fast, poisson_workload(10, 20, seed=1, mode="whole")).summary()
    assert summary["refused"] == 0 and summary["unfinished"] == 0 and summary["underrun_requests"] == 0
    assert summary["stages"]["first_audio"]["steps"] > 100 and "prefill" not in summary["stages"]


def test_a_chain_longer_than_a_short_step_gives_way_to_three_steps():
    """On the pinned profile itself the chain is 25 ms, past max_step_s (20 ms): after the first (unmeasured until
    then) every segment starts with three steps again, and 10 RPS runs without an underrun. Chained throughout,
    the same load had p95 first audio 106 ms and three underrunning streams (newcomers queued behind whole
    chains)."""
    summary = simulate(three_steps(first_audio_chain=True), H200,
                       poisson_workload(10, 20, seed=1, mode="whole")).summary()
    assert summary["stages"]["first_audio"]["steps"] == 1 and summary["stages"]["prefill"]["steps"] > 100
    assert summary["refused"] == 0 and summary["underrun_requests"] == 0 and summary["ttfa_ms"]["p95"] <= 80.0


def test_leading_silence_the_trimmer_drops_never_counts_as_buffered_audio():
    """Real weights start a segment with silent frames; the server drops them and reports the onset. The listener
    plays from its first audible audio, so the scheduler's clock must neither count the dropped silence as
    buffered nor start playback at the silent first chunk. When it did, streams looked 100+ ms safer than they
    were: 9 streams underran in this run (none since)."""
    cfg = three_steps(first_audio_chain=True, collect_first_audio_at_once=True)
    arrivals = poisson_workload(20, 30, seed=0, mode="whole", silent_frames=2)
    summary = simulate(cfg, faster(H200, 0.3), arrivals, SimOptions(host_step_s=0.001)).summary()
    assert summary["refused"] == 0 and summary["unfinished"] == 0
    assert summary["underrun_requests"] == 0 and summary["stall_ms"] == 0


def test_newcomers_without_audio_go_before_newcomers_whose_first_chunks_were_silent():
    """Within the first-audio class a request still waiting for its first chunk (one chained step away from audio)
    goes before one whose first chunks were silent (a frame or more away, and already started): the silent one
    used to keep its arrival order and hold later newcomers' chains back by a whole frame's steps."""
    cfg = three_steps(first_audio_chain=True)
    fast = faster(H200, 0.3)
    silent = one("a " * 30, silent=3)
    report = simulate(cfg, fast, [silent, one(at=0.010, index=1)])
    chain = HOST + fast.step_s(Stage.FIRST_AUDIO, 1, 1)
    # the second arrives while the first is still silent (its onset is 3 frames in): its own chain starts at
    # once after the step in flight, so its first audio is within two chains of its arrival (36.8 ms before)
    assert report.listeners[1].ttfa_s <= 2 * chain + 0.002, f"{report.listeners[1].ttfa_s * 1e3:.1f} ms"



@pytest.mark.parametrize("reports_onset", [True, False])
def test_the_player_acks_with_or_without_onset_reports(reports_onset):
    """--no-onset changes what the server tells the scheduler, not the player: its acks reach the scheduler either
    way, and only the onset report carries the dropped silence."""
    sim = Simulation(three_steps(), H200, [one("a " * 20, silent=2)],
                     SimOptions(ack_interval_s=0.05, reports_onset=reports_onset))
    seen, audible = [], []
    playback, mark = sim.scheduler.playback, sim.scheduler.mark_audible
    sim.scheduler.playback = lambda *a: (seen.append(a), playback(*a))[1]
    sim.scheduler.mark_audible = lambda *a: (audible.append(a), mark(*a))[1]
    sim.run()
    assert len(seen) > 5
    assert len(audible) == (1 if reports_onset else 0)
    if reports_onset:
        assert audible[0][2] == pytest.approx(2 * 0.08)  # two silent frames dropped
