"""Where first audio goes, on a live CPU server of its own (its counts start at zero): one HTTP request and one
WebSocket context each leave one observation per phase in voicelane_first_audio_phase_seconds, the phases add up
to that context's voicelane_ttfa_seconds, and the request's log line lists them."""

from __future__ import annotations

import http.client
import json

import pytest
from live_server import Raw, http_get, run, speak_ctx, start_server
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import FIRST_AUDIO_PHASES


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    srv = start_server(tiny_checkpoint, ["--bench-frames-per-word", "2", "--max-contexts", "8"])
    yield srv
    srv.stop()


def samples(server) -> dict[tuple, float]:
    status, _, text = http_get(server.http_url + "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def speak_http(server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/audio/speech", body=json.dumps({"input": "Hello world, how are you?", "voice": "ryan",
                                                              "response_format": "pcm"}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.read()
    conn.close()


async def speak_ws(server) -> None:
    raw = await Raw.open(server.ws_url)
    await speak_ctx(raw, "c", ["Hello ", "world, ", "how ", "are ", "you?"])
    done = await raw.expect("context.done", context_id="c")
    assert done["reason"] == "completed" and done["ttfa_ms"] is not None
    await raw.close()


def test_each_context_leaves_one_observation_per_phase_summing_to_its_ttfa(server):
    speak_http(server)
    run(speak_ws(server))
    s = samples(server)
    for transport in ("http", "ws"):
        assert s[("voicelane_ttfa_seconds_count", (("transport", transport),))] == 1
        ttfa = s[("voicelane_ttfa_seconds_sum", (("transport", transport),))]
        total = 0.0
        for phase in FIRST_AUDIO_PHASES:
            labels = (("phase", phase), ("transport", transport))
            assert s[("voicelane_first_audio_phase_seconds_count", labels)] == 1, (transport, phase)
            seconds = s[("voicelane_first_audio_phase_seconds_sum", labels)]
            assert seconds >= 0, (transport, phase, seconds)
            total += seconds
        assert total == pytest.approx(ttfa, abs=1e-3), transport
        # the model's parts took time on a CPU, each its own (the first-audio chain marks where each ends); the
        # text's hand-over to the engine too (stamped before the engine has it, so never cut to zero)
        for part in ("server_in", "engine_in", "prefill", "code_predictor", "codec"):
            assert s[("voicelane_first_audio_phase_seconds_sum", (("phase", part), ("transport", transport)))] > 0, \
                (transport, part)
    log = server.log_text()
    for ended in ("speech request ended", "context c ended"):
        line = next(x for x in log.splitlines() if ended in x)
        assert "first audio ms: server_in " in line and ", send " in line, line
