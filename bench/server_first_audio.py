"""The server's own account of first audio over a load point's measured window (docs/benchmarks/README.md, "Where
first audio goes"): its /metrics scraped when the window starts and when it ends, parsed with prometheus_client's
parser, and the difference of its first-audio histograms summarised beside the client's audible TTFA.

The server observes `voicelane_ttfa_seconds{transport}` and `voicelane_first_audio_phase_seconds{transport, phase}`
once per context, when its first audio is handed to the socket; the phases add up to that context's TTFA. The
window's difference counts the contexts whose first audio went out inside it: the requests that arrived in it,
shifted by their TTFA (the few at its edges may trade places with their neighbours).
"""

from __future__ import annotations

import asyncio
import http.client
import math
import urllib.error
import urllib.request
from dataclasses import dataclass

from bench import metrics

TTFA = "voicelane_ttfa_seconds"
PHASE = "voicelane_first_audio_phase_seconds"
# server.metrics.FIRST_AUDIO_PHASES, in order (the load generator is a client: it does not import the server);
# a phase the server adds later is reported after these.
PHASES = ("server_in", "engine_in", "queue", "behind", "launch", "prefill", "code_predictor", "codec", "collect",
          "deliver", "encode", "send")
# The engine loop's own accounting (server/metrics.py engine_families): steps launched, the engine thread's host
# time, the device's idle gaps between consecutive steps and each stage's step time.
ITERATIONS, HOST = "voicelane_engine_iterations", "voicelane_engine_host_seconds"
IDLE, STEP = "voicelane_engine_device_idle_seconds", "voicelane_engine_step_seconds"
QUANTILES = (0.50, 0.95)


@dataclass(frozen=True)
class Histogram:
    """One Prometheus histogram series: cumulative counts per upper bound (ascending, +Inf last), seconds."""

    bounds: tuple[float, ...]  # bucket upper bounds (`le`), the last one +Inf
    cumulative: tuple[float, ...]  # observations <= each bound
    total: float  # the series' _sum
    count: float  # the series' _count

    def minus(self, before: Histogram | None) -> Histogram:
        """The observations made since `before` (None: since the server started)."""
        if before is None:
            return self
        if before.bounds != self.bounds:
            raise ValueError("the histogram's buckets changed between the scrapes (was the server restarted?)")
        return Histogram(self.bounds, tuple(a - b for a, b in zip(self.cumulative, before.cumulative, strict=True)),
                         self.total - before.total, self.count - before.count)

    def quantile(self, q: float) -> float:
        """The q-quantile estimated the way Prometheus' histogram_quantile() does: find the bucket holding rank
        q * count and interpolate linearly inside it (observations assumed spread evenly over the bucket, the first
        bucket starting at 0); a rank in the +Inf bucket answers the largest finite bound. nan without
        observations. Its error is at most the width of the bucket it falls in."""
        if self.count <= 0:
            return math.nan
        rank = q * self.count
        below, lower = 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative, strict=True):
            if cumulative >= rank and cumulative > below:
                if math.isinf(bound):
                    return lower
                return lower + (bound - lower) * (rank - below) / (cumulative - below)
            below, lower = cumulative, bound
        return lower

    def stats_ms(self) -> dict:
        """count, mean (exact: _sum / _count) and the estimated p50 / p95, in ms."""
        mean = self.total / self.count * 1e3 if self.count > 0 else math.nan
        return {"count": int(self.count), "mean": mean,
                **{f"p{round(q * 100)}": self.quantile(q) * 1e3 for q in QUANTILES}}


def histograms(text: str, name: str) -> dict[tuple[tuple[str, str], ...], Histogram]:
    """Every series of histogram `name` in an exposition, by its labels (sorted, `le` left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[tuple, list[tuple[float, float]]] = {}
    sums: dict[tuple, float] = {}
    counts: dict[tuple, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for s in family.samples:
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            if s.name == name + "_bucket":
                buckets.setdefault(key, []).append((float(s.labels["le"]), s.value))
            elif s.name == name + "_sum":
                sums[key] = s.value
            elif s.name == name + "_count":
                counts[key] = s.value
    out = {}
    for key, rows in buckets.items():
        rows.sort()
        out[key] = Histogram(tuple(b for b, _ in rows), tuple(c for _, c in rows), sums.get(key, 0.0),
                             counts.get(key, rows[-1][1]))
    return out


def transport_of(workload: str) -> str:
    """The server's `transport` label for a workload's requests: W1 is HTTP, W2 and W3 the WebSocket."""
    return "http" if workload == "w1" else "ws"


def client_ttfa(records: list[dict]) -> dict:
    """The client's audible TTFA (ms) over the measured requests that were heard: count, p50, mean. The server
    observes only contexts that sent audio, so refused and silent requests (+inf in the summary) are left out."""
    heard = [r["audible_ttfa_ms"] for r in records if r["status"] in ("ok", "cancelled")
             and r.get("audible_ttfa_ms") is not None and math.isfinite(r["audible_ttfa_ms"])]
    return {"count": len(heard), "p50": metrics.percentile(heard, 50),
            "mean": sum(heard) / len(heard) if heard else math.nan}


def breakdown(start: str, end: str, transport: str, client_ttfa_ms: dict) -> dict:
    """The report's `server_first_audio` section from the two scrapes' texts: per phase and for the server-side
    TTFA, count, mean and p50 / p95 (ms) of the window's observations, and the client's audible TTFA of the heard
    requests (client_ttfa()) beside it and minus it."""
    before, after = histograms(start, TTFA), histograms(end, TTFA)
    key = (("transport", transport),)
    if key not in after:
        return {"transport": transport, "error": f"no {TTFA}{{transport={transport!r}}} in the server's /metrics"}
    ttfa = after[key].minus(before.get(key)).stats_ms()
    before, after = histograms(start, PHASE), histograms(end, PHASE)
    phases = {}
    for labels, hist in after.items():
        label = dict(labels)
        if label.get("transport") == transport:
            phases[label.get("phase", "")] = hist.minus(before.get(labels)).stats_ms()
    order = [p for p in PHASES if p in phases] + sorted(set(phases) - set(PHASES))
    return {"transport": transport, "ttfa_ms": ttfa, "phases_ms": {p: phases[p] for p in order},
            "client_audible_ttfa_ms": client_ttfa_ms,
            "client_minus_server_ms": {q: client_ttfa_ms.get(q, math.nan) - ttfa[q] for q in ("p50", "mean")},
            "engine_loop": engine_loop(start, end)}


def counter(text: str, name: str) -> float | None:
    """The value of an unlabelled counter family `name` in an exposition (None: not there)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(s.value for s in family.samples if s.name == name + "_total")
    return None


def engine_loop(start: str, end: str) -> dict | None:
    """The engine loop over the window: steps launched, the engine thread's host time per step, the device's busy
    time (the stages' step times) and its idle gaps between steps (count, total, mean and p50 / p95 of a gap, and
    the idle share of busy + idle). None for a server without these series."""
    counts = [(counter(start, name), counter(end, name)) for name in (ITERATIONS, HOST)]
    idle_after = histograms(end, IDLE).get(())
    if idle_after is None or any(a is None or b is None for a, b in counts):
        return None
    (it0, it1), (host0, host1) = counts
    steps = it1 - it0
    idle = idle_after.minus(histograms(start, IDLE).get(()))
    busy_before = histograms(start, STEP)
    busy = sum(h.total - (busy_before[k].total if k in busy_before else 0.0)
               for k, h in histograms(end, STEP).items())
    return {"steps": int(steps), "host_ms_per_step": (host1 - host0) / steps * 1e3 if steps else math.nan,
            "busy_ms": busy * 1e3, "idle_ms": idle.total * 1e3,
            "idle_share": idle.total / (idle.total + busy) if idle.total + busy > 0 else math.nan,
            "idle_gap_ms": idle.stats_ms()}


def fetch_text(url: str, timeout: float = 5.0) -> str:
    """GET {url}/metrics as text (raises on failure: the caller reports why)."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as r:
        return r.read().decode("utf-8", "replace")


async def scrape(url: str) -> str | Exception:
    """/metrics now, off the event loop (the load must not wait for it); the exception instead when it failed."""
    try:
        return await asyncio.get_running_loop().run_in_executor(None, fetch_text, url)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        return e


def window_breakdown(start: str | Exception | None, end: str | Exception | None, workload: str,
                     client_ttfa_ms: dict) -> dict:
    """breakdown() of a point's two scrapes, or why there is none (a scrape failed or never happened, a server
    without the series)."""
    transport = transport_of(workload)
    for name, text in (("start", start), ("end", end)):
        if not isinstance(text, str):
            why = "not taken" if text is None else f"{type(text).__name__}: {text}"
            return {"transport": transport, "error": f"/metrics at the window's {name}: {why}"}
    try:
        return breakdown(start, end, transport, client_ttfa_ms)
    except ValueError as e:  # the parser's answer to a text that is not an exposition, or changed buckets
        return {"transport": transport, "error": f"/metrics: {e}"}


def table(section: dict) -> str:
    """The section as a short text table (the load generator prints it after each point)."""
    if "error" in section:
        return f"server first audio ({section['transport']}): {section['error']}"
    ttfa = section["ttfa_ms"]
    lines = [f"server first audio ({section['transport']}, {ttfa['count']} contexts), ms:",
             f"  {'phase':<18}{'count':>7}{'mean':>9}{'p50':>9}{'p95':>9}"]
    rows = [*section["phases_ms"].items(), ("= server TTFA", ttfa)]
    for name, s in rows:
        lines.append(f"  {name:<18}{s['count']:>7}{s['mean']:>9.2f}{s['p50']:>9.2f}{s['p95']:>9.2f}")
    client, gap = section["client_audible_ttfa_ms"], section["client_minus_server_ms"]
    lines.append(f"  client audible TTFA ({client['count']} heard): p50 {client['p50']:.2f}, mean "
                 f"{client['mean']:.2f}; minus the server's: p50 {gap['p50']:.2f}, mean {gap['mean']:.2f}")
    loop = section.get("engine_loop")
    if loop:
        g = loop["idle_gap_ms"]
        lines.append(f"  engine loop: {loop['steps']} steps, host {loop['host_ms_per_step']:.2f} ms a step; device "
                     f"idle between steps {loop['idle_share'] * 100:.1f}% ({g['count']} gaps, mean {g['mean']:.3f}, "
                     f"p50 {g['p50']:.3f}, p95 {g['p95']:.3f} ms)")
    return "\n".join(lines)
