"""/metrics exposition (server/metrics.py) without a server: the series names, labels and values a scrape reads,
parsed back with the client library's own parser."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import EngineStats, FirstAudioTimes, LoopStats, PrefixCacheStats, StageStats
from server.metrics import (
    ENGINE_STEP_BUCKETS_S,
    FIRST_AUDIO_PHASES,
    ServerMetrics,
    first_audio_phases,
)


def samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


ENGINE_STATS = EngineStats(
    contexts=2, requests=2, free_slots=30, waiting_first_audio=1, text_starved=0,
    queue_depth={"talker": 3, "codec": 0}, pacing=True,
    stages={"talker": StageStats(steps=4, rows=10, seconds=0.5, last_batch=2,
                                 histogram=[1, 0, 2, 0, 0, 0, 0, 0, 0, 1, 0])},
    kv_cache_bytes=4096, open_contexts=2, max_slots=128,
    prefix_cache=PrefixCacheStats(hits=7, misses=3, evictions=1, invalidations=0, entries=2, bytes=2048,
                                  max_entries=256, max_bytes=1 << 28),
    loop=LoopStats(iterations=40, host_s=0.012, idle_s=0.0031, idle_gaps=39,
                   idle_histogram=[30, 5, 2, 1, 1, 0, 0, 0]),
)


def test_server_series_keep_their_names_labels_and_values():
    m = ServerMetrics()
    m.errors.inc("ws", "overloaded")
    m.errors.inc("ws", "overloaded")
    m.audio_seconds.inc("http", amount=1.5)
    m.active_contexts.inc("ws")
    m.active_contexts.inc("ws")
    m.active_contexts.dec("ws")
    m.sessions.set(value=4)
    m.ttfa.observe("http", value=0.012)
    m.slow_readers.inc()
    m.sessions_total.inc("1000")
    text = m.render(None, {"model": "tiny", "random_weights": "true"}, {"ready": True})
    assert "# TYPE voicelane_ws_sessions gauge" in text and "# TYPE voicelane_ws_sessions_total counter" in text
    s = samples(m.render(None, {"model": "tiny", "random_weights": "true"}, {"ready": True}))
    assert s[("voicelane_errors_total", (("code", "overloaded"), ("transport", "ws")))] == 2
    assert s[("voicelane_audio_seconds_total", (("transport", "http"),))] == 1.5
    assert s[("voicelane_active_contexts", (("transport", "ws"),))] == 1
    assert s[("voicelane_ws_sessions", ())] == 4
    assert s[("voicelane_slow_reader_disconnects_total", ())] == 1
    assert s[("voicelane_ws_sessions_total", (("close_code", "1000"),))] == 1
    assert s[("voicelane_ttfa_seconds_bucket", (("le", "0.01"), ("transport", "http")))] == 0
    assert s[("voicelane_ttfa_seconds_bucket", (("le", "0.015"), ("transport", "http")))] == 1
    assert s[("voicelane_ttfa_seconds_bucket", (("le", "+Inf"), ("transport", "http")))] == 1
    assert s[("voicelane_ttfa_seconds_count", (("transport", "http"),))] == 1
    assert s[("voicelane_info", (("model", "tiny"), ("random_weights", "true")))] == 1
    assert s[("voicelane_ready", ())] == 1
    assert not [name for name, _ in s if name.endswith("_created")]  # the hand-written format never had them
    assert m.errors.get("ws", "overloaded") == 2 and m.slow_readers.get() == 1 and m.underruns.get() == 0


def test_not_ready_and_no_engine():
    s = samples(ServerMetrics().render(None, {"model": "", "random_weights": "false"}, None))
    assert s[("voicelane_ready", ())] == 0
    assert not [name for name, _ in s if name.startswith("voicelane_engine_")]


def test_engine_series_from_stats():
    s = samples(ServerMetrics().render(ENGINE_STATS, {"model": "m", "random_weights": "false"}, {"ready": True}))
    assert s[("voicelane_engine_free_slots", ())] == 30
    assert s[("voicelane_engine_pacing", ())] == 1
    assert s[("voicelane_engine_kv_cache_bytes", ())] == 4096
    assert s[("voicelane_engine_max_slots", ())] == 128
    assert s[("voicelane_prefix_cache_hits_total", ())] == 7
    assert s[("voicelane_prefix_cache_misses_total", ())] == 3
    assert s[("voicelane_prefix_cache_evictions_total", ())] == 1
    assert s[("voicelane_prefix_cache_invalidations_total", ())] == 0
    assert s[("voicelane_prefix_cache_entries", ())] == 2
    assert s[("voicelane_prefix_cache_bytes", ())] == 2048
    assert s[("voicelane_engine_queue_depth", (("stage", "talker"),))] == 3
    assert s[("voicelane_engine_batch_size", (("stage", "talker"),))] == 2
    assert s[("voicelane_engine_rows_total", (("stage", "talker"),))] == 10
    step = "voicelane_engine_step_seconds"
    assert s[(step + "_bucket", (("le", "0.001"), ("stage", "talker")))] == 1
    assert s[(step + "_bucket", (("le", "0.005"), ("stage", "talker")))] == 3  # cumulative, as Prometheus reads it
    assert s[(step + "_bucket", (("le", "+Inf"), ("stage", "talker")))] == 4
    assert s[(step + "_count", (("stage", "talker"),))] == 4
    assert s[(step + "_sum", (("stage", "talker"),))] == 0.5
    assert len(ENGINE_STATS.stages["talker"].histogram) == len(ENGINE_STEP_BUCKETS_S) == len(StageStats.BUCKETS_S)
    assert s[("voicelane_engine_iterations_total", ())] == 40
    assert s[("voicelane_engine_host_seconds_total", ())] == 0.012
    idle = "voicelane_engine_device_idle_seconds"
    assert s[(idle + "_bucket", (("le", "5e-05"),))] == 30
    assert s[(idle + "_bucket", (("le", "0.0005"),))] == 37
    assert s[(idle + "_bucket", (("le", "+Inf"),))] == 39 == s[(idle + "_count", ())]
    assert s[(idle + "_sum", ())] == 0.0031


def test_two_servers_in_one_process_count_apart():
    a, b = ServerMetrics(), ServerMetrics()
    a.underruns.inc()
    assert a.underruns.get() == 1 and b.underruns.get() == 0


def test_first_audio_phases_cut_the_ttfa_at_the_engines_points():
    times = FirstAudioTimes(arrival=10.001, prefill_planned=10.003, collected=10.015, ahead_done=10.004,
                            prefill_started=10.0045, prefill_done=10.006, code_predictor_done=10.009,
                            codec_done=10.0145, handed=10.0152, received=10.016)
    m = ServerMetrics()
    phases = m.observe_first_audio("ws", 10.0, 10.020, times, packets_at=10.018, text_handed_at=10.0004)
    assert list(phases) == list(FIRST_AUDIO_PHASES)
    expected = [0.0004, 0.0006, 0.002, 0.001, 0.0005, 0.0015, 0.003, 0.0055, 0.0005, 0.001, 0.002, 0.002]
    assert list(phases.values()) == pytest.approx(expected)
    assert sum(phases.values()) == pytest.approx(0.020)
    # without the hand-over's time, server_in runs to the engine's arrival; one past the arrival is held there
    assert first_audio_phases(10.0, times, 10.018, 10.020)["server_in"] == pytest.approx(0.001)
    late = first_audio_phases(10.0, times, 10.018, 10.020, text_handed_at=10.0012)
    assert late["server_in"] == pytest.approx(0.001) and late["engine_in"] == 0
    s = samples(m.render(None, {"model": "m"}, None))
    queue = (("phase", "queue"), ("transport", "ws"))
    assert s[("voicelane_first_audio_phase_seconds_bucket", (("le", "0.00175"),) + queue)] == 0
    assert s[("voicelane_first_audio_phase_seconds_bucket", (("le", "0.00225"),) + queue)] == 1  # 2 ms, 0.25 ms steps
    assert s[("voicelane_ttfa_seconds_count", (("transport", "ws"),))] == 1
    # the first bytes sent held no packet (a WAV header): encoding runs to the send; no record, no phases
    assert first_audio_phases(10.0, times, None, 10.020)["encode"] == pytest.approx(0.004)
    assert first_audio_phases(10.0, times, None, 10.020)["send"] == 0
    assert m.observe_first_audio("http", 10.0, 10.02, None, None) == {}


def test_device_points_unknown_or_off_the_host_clock_stay_between_their_neighbours():
    # nothing queued ahead (no point), a prefill start mapped a few us before the plan, a codec end after the collect
    times = FirstAudioTimes(arrival=10.001, prefill_planned=10.003, collected=10.015, ahead_done=None,
                            prefill_started=10.00299, prefill_done=10.006, code_predictor_done=10.009,
                            codec_done=10.01501)
    phases = first_audio_phases(10.0, times, 10.018, 10.020)
    assert phases["behind"] == 0 and phases["launch"] == 0 and phases["collect"] == 0
    assert phases["prefill"] == pytest.approx(0.003) and phases["codec"] == pytest.approx(0.006)
    assert min(phases.values()) >= 0 and sum(phases.values()) == pytest.approx(0.020)
    # a record without device times: planned -> collected is all "collect"
    bare = FirstAudioTimes(arrival=10.001, prefill_planned=10.003, collected=10.015)
    phases = first_audio_phases(10.0, bare, 10.018, 10.020)
    assert phases["collect"] == pytest.approx(0.012)
    assert all(phases[p] == 0 for p in ("behind", "launch", "prefill", "code_predictor", "codec"))
