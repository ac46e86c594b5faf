"""Client-side audio metrics, exactly as defined in docs/benchmarks/README.md section 1 (numpy only).

All times are in seconds on one monotonic clock (the load generator uses time.perf_counter()); results that are
durations are returned in milliseconds by `request_metrics`.

Definitions and the choices this module makes where the text leaves room:

- A *packet* is what the client received in one piece: one HTTP body chunk or one WebSocket binary message. It
  carries the samples [start, start + n) of the stream; packets with n == 0 (an empty WebSocket `last` packet,
  or an HTTP chunk that completes no sample) carry nothing playable and are ignored by the audio metrics.
- First playable: dispatch -> arrival of the first packet that completes a PCM sample.
- Playback model (for underruns and audible TTFA): playback starts when the first playable packet arrives, with
  NO pre-buffer, and runs at 1x. Packet k is due at  T0 + (start_k - start_0) / sr + stall_so_far.  If it
  arrives after its due time (strictly later) it is an underrun: the player stalls until it arrives and resumes
  from there, so the whole later schedule shifts by that stall (samples are never dropped; this is what a
  real player does). stall_ms is the sum of those waits, i.e. how much later the last sample plays than it
  would have without underruns. The first underrun of a request, and so the underrun-request gate, is the same
  whether or not the schedule shifts; only the packet count and stall total after a first stall depend on it.
- Audible onset: RMS over a 20 ms window stepped every 10 ms, each window's mean (DC) removed, in dBFS
  = 20*log10(RMS) with full scale = 1.0 (int16 is divided by 32768). So a full-scale square wave reads 0 dBFS
  and a full-scale sine -3.01 dBFS (the AES17 convention would read the sine 0 dBFS; ours is the stricter of
  the two by 3 dB). Audible = above -45 dBFS in two consecutive windows; the onset is the first sample of the
  first of the two. Only complete windows are examined. The onset is therefore up to one window (20 ms) earlier
  than the true start of a loud sound, and never later than it by more than a hop for a sound well above the
  threshold.
- Audible TTFA: dispatch -> the moment the onset sample *plays* on the client's playback timeline above (so
  leading silence the server sends counts against it, and so does a stall before the onset). If the stream has
  no audible onset at all, audible TTFA is +inf (the listener never heard anything).
- A request that underran keeps its playback timeline (`timeline_ms`: each packet's arrival, play time, audio
  start and length), so a report shows which packet was late and by how much.
- E2E: dispatch -> arrival of the last byte (HTTP: the last body chunk; WebSocket: the `last` audio packet).
- Percentiles use linear interpolation between order statistics (numpy's default method) and accept +inf:
  a refused or failed request enters every latency percentile as +inf, so percentiles are over the requests
  offered, not over those admitted, and a p95 with more than 5% failures is +inf (fails any SLO).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 24000
WINDOW_S = 0.020
HOP_S = 0.010
THRESHOLD_DBFS = -45.0
INF = math.inf


@dataclass(frozen=True)
class Packet:
    t: float  # arrival time (s)
    start: int  # index of its first sample in the stream
    n: int  # number of complete samples it carries


def packets_from_byte_chunks(chunks, bytes_per_sample: int = 2) -> list[Packet]:
    """HTTP body chunks [(arrival_time, byte_count), ...] of one raw PCM stream -> packets of complete samples.

    A chunk may split a sample; a sample belongs to the chunk that completes it."""
    out, total = [], 0
    for t, nbytes in chunks:
        first = total // bytes_per_sample
        total += int(nbytes)
        last = total // bytes_per_sample
        out.append(Packet(float(t), first, last - first))
    return out


def playable(packets) -> list[Packet]:
    return [p for p in packets if p.n > 0]


def first_playable_time(packets) -> float | None:
    """Arrival time of the first packet carrying a complete sample (None if none)."""
    pk = playable(packets)
    return pk[0].t if pk else None


@dataclass
class Playback:
    t0: float  # playback start (= first playable arrival)
    start0: int  # sample index playing at t0
    underruns: int  # packets that arrived after they were due
    stall_s: float  # total time playback waited for late packets
    starts: list[float]  # actual playback start time of each playable packet, in arrival order
    packets: list[Packet]  # the playable packets, in arrival order
    sr: int = SAMPLE_RATE

    def play_time(self, sample: int) -> float | None:
        """When `sample` plays (None if no packet carried it)."""
        for p, s in zip(self.packets, self.starts, strict=True):
            if p.start <= sample < p.start + p.n:
                return s + (sample - p.start) / self.sr
        return None

    @property
    def end(self) -> float:
        """When the last sample finishes playing."""
        if not self.packets:
            return self.t0
        p, s = self.packets[-1], self.starts[-1]
        return s + p.n / self.sr


def simulate_playback(packets, sr: int = SAMPLE_RATE, until: float | None = None) -> Playback | None:
    """Zero-pre-buffer 1x playback of the packets (see the module docstring). Packets arriving after `until`
    (e.g. a barge-in) are left out. Returns None when no playable packet arrived."""
    pk = [p for p in playable(packets) if until is None or p.t <= until]
    if not pk:
        return None
    t0, start0 = pk[0].t, pk[0].start
    stall, underruns, starts = 0.0, 0, []
    for i, p in enumerate(pk):
        due = t0 + (p.start - start0) / sr + stall
        if i > 0 and p.t > due:
            underruns += 1
            stall += p.t - due
            due = p.t
        starts.append(due)
    return Playback(t0, start0, underruns, stall, starts, pk, sr)


def to_float(samples) -> np.ndarray:
    a = np.asarray(samples)
    if a.dtype == np.int16:
        return a.astype(np.float64) / 32768.0
    return a.astype(np.float64)


def pcm16_from_bytes(data: bytes) -> np.ndarray:
    n = len(data) // 2
    return np.frombuffer(data[: 2 * n], dtype="<i2")


def window_levels_dbfs(samples, sr: int = SAMPLE_RATE, window_s: float = WINDOW_S, hop_s: float = HOP_S):
    """(window start indices, level in dBFS) of every complete window, DC removed per window."""
    x = to_float(samples)
    win, hop = int(round(window_s * sr)), int(round(hop_s * sr))
    if len(x) < win:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    frames = np.lib.stride_tricks.sliding_window_view(x, win)[::hop]
    centered = frames - frames.mean(axis=1, keepdims=True)
    rms = np.sqrt(np.mean(centered * centered, axis=1))
    with np.errstate(divide="ignore"):
        db = 20.0 * np.log10(rms)
    return np.arange(len(frames), dtype=np.int64) * hop, db


def audible_onset(samples, sr: int = SAMPLE_RATE, threshold_dbfs: float = THRESHOLD_DBFS,
                  window_s: float = WINDOW_S, hop_s: float = HOP_S) -> int | None:
    """Index of the first audible sample (start of the first of two consecutive windows above the threshold),
    or None if the signal never becomes audible."""
    starts, db = window_levels_dbfs(samples, sr, window_s, hop_s)
    above = db > threshold_dbfs
    both = above[:-1] & above[1:]
    hits = np.flatnonzero(both)
    return int(starts[hits[0]]) if hits.size else None


def percentile(values, q: float) -> float:
    """Linear-interpolation percentile (numpy's default) that accepts +inf; nan for an empty input."""
    v = np.sort(np.asarray(list(values), dtype=np.float64))
    if v.size == 0:
        return math.nan
    h = (v.size - 1) * q / 100.0
    lo, hi = int(math.floor(h)), int(math.ceil(h))
    if lo == hi or v[lo] == v[hi]:
        return float(v[lo])
    if math.isinf(v[hi]):
        return INF
    return float(v[lo] + (h - lo) * (v[hi] - v[lo]))


def percentiles(values, qs=(50, 95, 99)) -> dict:
    return {f"p{q:g}": percentile(values, q) for q in qs}


def playback_timeline(pb: Playback, dispatch: float) -> list[list[float]]:
    """[arrival, plays at, audio start, audio length] per playable packet, ms (times since dispatch, audio on the
    stream's own clock): a late packet is one whose arrival equals its play time after the first."""
    return [[round((p.t - dispatch) * 1e3, 2), round((s - dispatch) * 1e3, 2),
             round((p.start - pb.start0) / pb.sr * 1e3, 2), round(p.n / pb.sr * 1e3, 2)]
            for p, s in zip(pb.packets, pb.starts, strict=True)]


def request_metrics(dispatch: float, packets, samples=None, sr: int = SAMPLE_RATE, last_byte: float | None = None,
                    until: float | None = None) -> dict:
    """The per-request metrics of docs/benchmarks/README.md 1 from one stream's packets (and its decoded samples, for
    audibility). Durations in ms; missing values are None except audible TTFA (+inf when never audible)."""
    pb = simulate_playback(packets, sr, until)
    out = {"first_playable_ms": None, "audible_ttfa_ms": None, "audible_arrival_ms": None, "onset_ms": None,
           "e2e_ms": None, "underruns": 0, "stall_ms": 0.0, "audio_ms": 0.0, "packets": len(playable(packets))}
    if last_byte is not None:
        out["e2e_ms"] = (last_byte - dispatch) * 1e3
    if pb is None:
        return out
    out["first_playable_ms"] = (pb.t0 - dispatch) * 1e3
    out["underruns"] = pb.underruns
    out["stall_ms"] = pb.stall_s * 1e3
    if pb.underruns:  # the evidence to explain it later: every packet's arrival beside when it played
        out["timeline_ms"] = playback_timeline(pb, dispatch)
    out["audio_ms"] = sum(p.n for p in pb.packets) / sr * 1e3
    if samples is not None:
        x = np.asarray(samples)
        if until is not None:
            x = x[: max((p.start + p.n for p in pb.packets), default=0)]
        onset = audible_onset(x[: 2 * sr], sr)  # the same answer when it lies there, and much cheaper
        if onset is None and len(x) > 2 * sr:
            onset = audible_onset(x, sr)
        if onset is None:
            out["audible_ttfa_ms"] = INF
        else:
            out["onset_ms"] = onset / sr * 1e3
            t = pb.play_time(onset)
            out["audible_ttfa_ms"] = INF if t is None else (t - dispatch) * 1e3
            arrival = next((p.t for p in pb.packets if p.start <= onset < p.start + p.n), None)
            out["audible_arrival_ms"] = None if arrival is None else (arrival - dispatch) * 1e3
    return out


LATENCY_KEYS = ("audible_ttfa_ms", "first_playable_ms", "e2e_ms")


def summarize(records, window_s: float, slo_ttfa_ms: float = 50.0) -> dict:
    """Per-point summary over the measured requests (dicts as written by the load generator).

    Each record has `status` ("ok", "cancelled" or an error kind: "refused", "error", "timeout", "client_cap"),
    and the metrics of `request_metrics`. Errors enter every latency percentile as +inf. A cancelled request
    (W3 barge-in) is not an error: its audible TTFA and first playable count, its E2E does not (it measures
    the cancel, not the server)."""
    offered = list(records)
    errors = [r for r in offered if r["status"] not in ("ok", "cancelled")]
    by_kind: dict[str, int] = {}
    for r in errors:
        by_kind[r["status"]] = by_kind.get(r["status"], 0) + 1

    def vals(key):
        out = []
        for r in offered:
            if r["status"] not in ("ok", "cancelled"):
                out.append(INF)
            elif key == "e2e_ms" and r["status"] == "cancelled":
                continue
            else:
                v = r.get(key)
                out.append(INF if v is None else float(v))
        return out

    lat = {}
    for key in LATENCY_KEYS:
        v = vals(key)
        lat[key] = {**percentiles(v), "mean": _finite_mean(v), "n": len(v),
                    "n_inf": int(sum(1 for x in v if math.isinf(x)))}
    good = [r for r in offered if r["status"] in ("ok", "cancelled")]
    underrun_requests = sum(1 for r in good if r.get("underruns", 0) > 0)
    summary = {
        "offered": len(offered),
        "ok": sum(1 for r in offered if r["status"] == "ok"),
        "cancelled": sum(1 for r in offered if r["status"] == "cancelled"),
        "errors": len(errors),
        "errors_by_kind": by_kind,
        "inaudible": sum(1 for r in good if r.get("audible_ttfa_ms") is not None and math.isinf(r["audible_ttfa_ms"])),
        "latency_ms": lat,
        "underrun_requests": underrun_requests,
        "underrun_packets": int(sum(r.get("underruns", 0) for r in good)),
        "total_stall_ms": float(sum(r.get("stall_ms", 0.0) for r in good)),
        "offered_rps": len(offered) / window_s if window_s > 0 else math.nan,
        "achieved_rps": sum(1 for r in offered if r["status"] == "ok") / window_s if window_s > 0 else math.nan,
        "audio_s": float(sum(r.get("audio_ms", 0.0) for r in good)) / 1e3,
    }
    summary["slo"] = slo_verdict(summary, slo_ttfa_ms)
    return summary


def slo_verdict(summary: dict, slo_ttfa_ms: float = 50.0) -> dict:
    p95 = summary["latency_ms"]["audible_ttfa_ms"]["p95"]
    checks = {
        "p95_audible_ttfa_ms": p95,
        "limit_ms": slo_ttfa_ms,
        "ttfa_ok": (not math.isnan(p95)) and p95 <= slo_ttfa_ms,
        "underruns_ok": summary["underrun_requests"] == 0,
        "errors_ok": summary["errors"] == 0,
        "nonempty": summary["offered"] > 0,
    }
    checks["pass"] = checks["ttfa_ok"] and checks["underruns_ok"] and checks["errors_ok"] and checks["nonempty"]
    return checks


def _finite_mean(v) -> float:
    f = [x for x in v if math.isfinite(x)]
    return float(np.mean(f)) if f else math.nan
