"""The browser demo page (client_demo/web/) in Debian's headless Chromium, against a live CPU server.

One short utterance and one barge-in, driven through the page's own controls:

- the page connects with an API key (subprotocol `bearer.<key>`), fills voices and languages from
  session.created;
- "Speak" streams one utterance: raw Opus packets decoded by WebCodecs `AudioDecoder`, pre-skip dropped, played
  through the AudioWorklet jitter buffer. The decoded duration equals the server's `context.done.audio_ms`
  within 20 ms (the last Opus packet's padding), every decoded sample is rendered by the worklet, and the
  playback acks reach the server (its /metrics counts them);
- the simulated LLM streams a paragraph word by word; Space barges in once audio plays: the worklet drops the
  queued audio at once (no sample of that context is rendered after the clear) and the server answers
  `context.cancelled`;
- a screenshot is saved (tmp path; also to $VOICELANE_SCREENSHOT, e.g. docs/demo.png).

Headless Chromium has no audio device, yet its AudioContext runs on a real-time clock (verified with
Chromium 156: currentTime advances 1 s per second with --autoplay-policy=no-user-gesture-required), so the
worklet's count of rendered samples is real playback. Underruns are printed, never asserted: CI's two cores are
shared with the browser. The server runs in benchmark length mode (`--bench-frames-per-word 3`) so the random
weights speak for a predictable length.

Needs the Python package playwright (never `playwright install`: it drives /usr/bin/chromium, Debian's package
`chromium`). Without them the test is skipped, or fails when $CI is set.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from live_server import start_server

ROOT = Path(__file__).resolve().parent.parent
WEB = ROOT / "client_demo" / "web"
CHROMIUM = os.environ.get("VOICELANE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--autoplay-policy=no-user-gesture-required", "--disable-dev-shm-usage"]
API_KEY = "demo-test-key"
SPEAK_TEXT = "Hello there, this is a short test of the voicelane demo page."  # 12 words: 36 frames, 2.9 s
FRAMES_PER_WORD = 3


def _missing(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI installs it: see .ci/run)")
    pytest.skip(reason)


try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - depends on the machine
    sync_playwright = None


def _get(url: str, timeout: float = 5.0) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        return None, str(e)


@pytest.fixture
def chromium() -> str:
    if sync_playwright is None:
        _missing("the Python package playwright is not installed (pip install playwright)")
    if not Path(CHROMIUM).exists():
        _missing(f"Debian's chromium is not installed ({CHROMIUM}): apt-get install chromium")
    return CHROMIUM


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    """A private server (tests/live_server.py): with an API key, and its /metrics counting only this test's acks."""
    srv = start_server(tiny_checkpoint, ["--api-key", API_KEY, "--bench-frames-per-word", str(FRAMES_PER_WORD)])
    yield srv.http_url
    srv.stop()


def _playback_reports(server: str) -> dict[str, float]:
    status, text = _get(server + "/metrics")
    assert status == 200, text[:500]
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("voicelane_client_playback_reports_total{"):
            labels, _, value = line.rpartition(" ")
            state = labels.split('state="', 1)[1].split('"', 1)[0]
            out[state] = out.get(state, 0.0) + float(value)
    return out


def _utterance(page, i: int):
    return page.evaluate(f"window.voicelane.snapshot().utterances[{i}] || null")


def test_server_serves_the_page(server):
    """`/` is client_demo/web/index.html, its modules beside it, without a key (docs/protocol.md 2)."""
    status, body = _get(server + "/")
    assert status == 200 and body == (WEB / "index.html").read_text(encoding="utf-8"), body[:300]
    for name in ("app.js", "audio.js", "protocol.js", "timeline.js", "worklet.js", "style.css"):
        status, body = _get(f"{server}/{name}")
        assert status == 200 and body == (WEB / name).read_text(encoding="utf-8"), name


def test_demo_page_plays_and_barges_in(chromium, server, tmp_path, record_property):
    url = server + "/"  # the page as the server serves it; it speaks to the same origin's /v1/tts/ws
    errors: list[str] = []
    t_start = time.monotonic()
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=chromium, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1360, "height": 900}, device_scale_factor=1)
        try:
            page = browser.new_page()
            page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
            page.on("console", lambda m: m.type == "error" and errors.append(f"console: {m.text}"))
            page.goto(url)

            # WebCodecs Opus must exist in Debian's chromium (a secure context: http://127.0.0.1).
            assert page.evaluate("""async () => typeof AudioDecoder === 'function' &&
                (await AudioDecoder.isConfigSupported({codec: 'opus', sampleRate: 48000, numberOfChannels: 1}))
                .supported"""), "WebCodecs AudioDecoder cannot decode Opus in this Chromium"

            # 1. connect with the key; voices come from session.created
            page.fill("#key", API_KEY)
            page.click("#connect")
            page.wait_for_function("window.voicelane.snapshot().connected", timeout=30_000)
            voices = page.eval_on_selector_all("#voice option", "os => os.map(o => o.value)")
            assert "ryan" in voices, voices
            snap = page.evaluate("window.voicelane.snapshot()")
            assert snap["codec"] == "opus" and snap["audio"]["state"] == "running", snap
            assert snap["audio"]["rate"] == 48000, snap["audio"]

            # 2. one utterance, decoded through WebCodecs and played
            page.fill("#text", SPEAK_TEXT)
            page.click("#speak")
            page.wait_for_function("(() => { const u = window.voicelane.snapshot().utterances[0];"
                                   " return u && u.final; })()", timeout=180_000)
            u = _utterance(page, 0)
            print("utterance:", json.dumps({k: v for k, v in u.items() if k != "done"}), "done:", u["done"])
            assert u["status"] == "done" and u["done"]["reason"] == "completed", u
            assert u["error"] is None, u
            assert u["pre_skip"] > 0 and u["source_rate"] == 48000, u
            assert u["packets"] > 10, u
            assert abs(u["decoded_ms"] - u["done"]["audio_ms"]) <= 20.0, (u["decoded_ms"], u["done"]["audio_ms"])
            # every decoded sample went through the worklet's output (the AudioContext runs at 48 kHz)
            assert abs(u["played_ms"] - u["decoded_ms"]) < 0.5, (u["played_ms"], u["decoded_ms"])
            assert u["acks"] >= 2, u
            # The server counts the reports of open contexts (the `finished` one usually comes after
            # context.done, which the server accepts silently).
            reports = _playback_reports(server)
            print("server playback reports:", reports)
            assert reports.get("playing", 0) >= 1, reports

            # 3. barge-in: stream the simulated LLM, press Space once its audio plays
            page.evaluate("""() => { const r = document.getElementById('rate'); r.value = '6';
                                     r.dispatchEvent(new Event('input')); }""")
            page.click("#llm-start")
            page.wait_for_function("(() => { const u = window.voicelane.snapshot().utterances[1];"
                                   " return u && u.played_ms > 300; })()", timeout=180_000)
            page.evaluate("document.activeElement && document.activeElement.blur()")
            page.keyboard.press("Space")
            page.wait_for_function("(() => { const u = window.voicelane.snapshot().utterances[1];"
                                   " return u && u.cancelled; })()", timeout=30_000)
            page.wait_for_timeout(800)  # anything still in flight arrives (and must be dropped)
            snap = page.evaluate("window.voicelane.snapshot()")
            b = snap["utterances"][1]
            print("barge-in:", json.dumps({k: v for k, v in b.items() if k != "cancelled"}),
                  "cancelled:", b["cancelled"])
            assert b["cancel_sent"] and b["status"] == "cancelled", b
            assert b["cancelled"]["type"] == "context.cancelled", b
            assert not snap["llm_active"], snap
            # silence from the next render quantum: nothing of that context (nor anything else) played after
            assert b["cleared_played_ms"] is not None and b["played_ms"] == b["cleared_played_ms"], b
            assert snap["audio"]["output_ms"] == b["output_at_clear_ms"], (snap["audio"], b)
            assert snap["audio"]["buffered_ms"] == 0, snap["audio"]
            print(f"underruns (shown, not asserted): {snap['audio']['underruns']}; late packets dropped: "
                  f"{snap['counters']['late']}; page: {url}")
            record_property("underruns", snap["audio"]["underruns"])  # in the JUnit XML report
            record_property("ttfa_played_ms", u["first_played_ms"])

            # 4. a refused context shows its code and message, not a bare "error" (issue 10, item 8)
            page.evaluate("""() => { const v = document.getElementById('voice'); const o = new Option('nobody');
                                     v.add(o); v.value = 'nobody'; v.dispatchEvent(new Event('change')); }""")
            page.fill("#text", "Refused.")
            page.click("#speak")
            page.wait_for_function("(() => { const u = window.voicelane.snapshot().utterances[2];"
                                   " return u && u.error; })()", timeout=30_000)
            refused = _utterance(page, 2)
            assert refused["error"].startswith("unknown_voice: "), refused
            status_line = page.text_content("#status")
            assert "refused: unknown_voice: " in status_line and "nobody" in status_line, status_line
            # the timeline table is redrawn on the page's readout timer, so its row may lag the utterance record
            shown = ("(() => { const c = document.querySelectorAll('#utterances tr:first-child td');"
                     " return c.length && c[c.length - 1].textContent.startsWith('unknown_voice: '); })()")
            try:
                page.wait_for_function(shown, timeout=5_000)
            finally:
                cells = page.eval_on_selector_all("#utterances tr:first-child td",
                                                  "tds => tds.map(t => t.textContent)")
            assert cells[-1].startswith("unknown_voice: "), cells
            page.wait_for_timeout(1_000)  # the text sent behind the refused create opens a default context: ended
            refused = _utterance(page, 2)
            assert refused["status"] == "error" and refused["decoded_samples"] == 0, refused
            page.select_option("#voice", "ryan")

            # 5. screenshot
            page.evaluate("window.scrollTo(0, 0)")
            page.wait_for_timeout(300)  # one more readout refresh
            shot = tmp_path / "demo.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if os.environ.get("VOICELANE_SCREENSHOT"):
                dest = Path(os.environ["VOICELANE_SCREENSHOT"])
                dest = dest if dest.is_absolute() else ROOT / dest
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(shot, dest)
        finally:
            browser.close()
    assert not errors, errors
    print(f"browser part: {time.monotonic() - t_start:.1f} s")
