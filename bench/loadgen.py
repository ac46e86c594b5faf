"""Open-loop load generator for voicelane (docs/benchmarks/README.md 1 and 2).

    python -m bench.loadgen --url http://127.0.0.1:8000 --workload w1 --rps 10 --warmup 30 --window 60 \\
        --seed 0 --out report.json [--server-cmd "voicelane serve ..."] [--baseline baseline.json]

One point: arrivals drawn in advance (Poisson or constant, seeded), sent at their times whatever the server does,
requests whose arrival falls in [warmup, warmup + window) measured. After the window, arrivals continue
(unmeasured, "cooldown"; --no-cooldown stops them) until every measured request has ended or --drain-timeout
passes, so the last measured requests see the same load as the others. An arrival that finds --max-in-flight
requests still open is not sent and counts as an error ("client_cap").

Workloads:
- w1: POST /v1/audio/speech, whole sentence, stream true, pcm (raw s16le 24 kHz); one packet per body chunk.
- w2: the WebSocket; context.create (pcm_24000), then one word and its trailing space per `text` message every
  --word-interval (10 ms), then context.close on the next tick. Sockets are kept open and reused (a pool; at most
  --contexts-per-socket contexts at a time on each); connecting happens before dispatch.
- w3: conversations. Users arrive at rps / turns per second (so about `rps` replies per second), each on its own
  socket, for --turns replies of 1-4 sentences streamed as LLM-sized pieces (words of more than 6 characters
  split into 4-character pieces) at 30-60 pieces per second, then context.close. 20% of replies are cancelled
  (context.cancel, barge-in) at a uniformly random point of their expected playback after the first audio.
  After each reply the user listens until its playback ends (or to the barge-in), pauses 0.5-2 s, and goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from bench import metrics, server_first_audio
from bench.prompts import SENTENCES, PromptStream
from bench.report import environment, fmt_ms, load_report, write_report
from bench.schedule import STREAM_WORKLOAD, make_schedule, rng

now = time.perf_counter
FRAME_S = 0.080  # one codec frame of the 12 Hz models: 1920 samples at 24 kHz
PROMPT_INDEX = {s: i for i, s in enumerate(SENTENCES)}


@dataclass
class PointConfig:
    url: str = "http://127.0.0.1:8000"
    workload: str = "w1"
    rps: float = 1.0
    arrival: str = "poisson"
    warmup: float = 30.0
    window: float = 60.0
    seed: int = 0
    max_in_flight: int = 4096
    drain_timeout: float = 60.0
    request_timeout: float = 120.0
    model: str = "voicelane"
    voice: str = "Ryan"
    language: str = "English"
    word_interval: float = 0.010
    contexts_per_socket: int = 1
    turns: int = 3
    barge_in: float = 0.2
    tokens_per_s: tuple[float, float] = (30.0, 60.0)
    sentences_per_reply: tuple[int, int] = (1, 4)
    pause_s: tuple[float, float] = (0.5, 2.0)
    api_key: str | None = None
    slo_ttfa_ms: float = 50.0
    records: str = "measured"  # which request records the report keeps: measured, all, none
    cooldown: bool = True  # keep the load on after the window until the measured requests have ended
    min_words: int = 0  # use only the prompts of min_words..max_words words (default: all of them)
    max_words: int = 1000
    # W1's HTTP client: "lean" (bench/http1.py, the clock next to the socket) or "httpx" (before 2026-12-04)
    http_client: str = "lean"
    # client processes: arrival i is sent by process i % procs, so that one Python event loop's lag (at tens of
    # requests a second it reaches milliseconds) does not stand in the measured times
    procs: int = 1

    def sentences(self) -> tuple[str, ...]:
        subset = tuple(s for s in SENTENCES if self.min_words <= len(s.split()) <= self.max_words)
        if not subset:
            raise ValueError(f"no prompt has {self.min_words}..{self.max_words} words")
        return subset


async def sleep_until(t: float) -> None:
    d = t - now()
    if d > 0:
        await asyncio.sleep(d)


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    if event.is_set():
        return True
    if timeout <= 0:
        return False
    try:
        await asyncio.wait_for(event.wait(), timeout)
        return True
    except asyncio.TimeoutError:
        return False


async def wait_any(events, timeout: float) -> None:
    if any(e.is_set() for e in events):
        return
    tasks = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(tasks, timeout=max(0.0, timeout), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def llm_pieces(text: str) -> list[str]:
    """Text cut the way an LLM streams it: words with their leading space, long words in 4-character pieces."""
    out = []
    for i, w in enumerate(text.split()):
        lead = "" if i == 0 else " "
        if len(w) <= 6:
            out.append(lead + w)
        else:
            parts = [w[k : k + 4] for k in range(0, len(w), 4)]
            out.append(lead + parts[0])
            out.extend(parts[1:])
    return out


def ws_url(base: str) -> str:
    base = base.rstrip("/")
    if base.startswith("https://"):
        return "wss://" + base[len("https://"):] + "/v1/tts/ws"
    if base.startswith("http://"):
        return "ws://" + base[len("http://"):] + "/v1/tts/ws"
    return base + "/v1/tts/ws"



def new_http_client(request_timeout: float, kind: str = "httpx", url: str = ""):
    """W1's HTTP client: "lean" (bench/http1.py: the clock next to the socket) or "httpx"."""
    if kind == "lean":
        from bench.http1 import Http1Pool

        return Http1Pool(url)
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(connect=10.0, read=request_timeout, write=10.0, pool=None),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                             trust_env=False)


async def http_speech(client, c: PointConfig, text: str, rec: dict) -> float:
    """One W1 request: POST /v1/audio/speech (stream, raw PCM); fills rec with the metrics; returns dispatch time.

    Dispatch is taken just before the request is handed to the client (headers and body leave together)."""
    body = {"model": c.model, "input": text, "voice": c.voice, "language": c.language,
            "response_format": "pcm", "stream": True}
    from bench.http1 import Http1Pool

    if isinstance(client, Http1Pool):
        return await _lean_speech(client, c, body, rec)
    import httpx

    headers = {"Authorization": f"Bearer {c.api_key}"} if c.api_key else None
    req = client.build_request("POST", c.url.rstrip("/") + "/v1/audio/speech", json=body, headers=headers)
    chunks, pcm = [], bytearray()
    t_d = now()
    try:
        resp = await client.send(req, stream=True)
        try:
            rec["http_status"] = resp.status_code
            if resp.status_code != 200:
                _http_failure(rec, resp.status_code, await resp.aread())
                return t_d
            async for chunk in resp.aiter_raw():
                if chunk:
                    chunks.append((now(), len(chunk)))
                    pcm += chunk
        finally:
            await resp.aclose()
    except httpx.TimeoutException as e:
        rec["status"], rec["error"] = "timeout", repr(e)
        return t_d
    except httpx.HTTPError as e:
        rec["status"], rec["error"] = "error", repr(e)
        return t_d
    _speech_result(rec, t_d, chunks, pcm)
    return t_d


def _http_failure(rec: dict, status: int, body: bytes) -> None:
    rec["status"] = "refused" if status in (429, 503) else "error"
    rec["error"] = f"HTTP {status}: {body[:300].decode('utf-8', 'replace')}"


def _speech_result(rec: dict, t_d: float, chunks: list[tuple[float, int]], pcm: bytearray) -> None:
    last = chunks[-1][0] if chunks else None
    rec.update(metrics.request_metrics(t_d, metrics.packets_from_byte_chunks(chunks),
                                       metrics.pcm16_from_bytes(bytes(pcm)), last_byte=last))
    rec["bytes"] = len(pcm)
    rec["chunks"] = len(chunks)
    if not pcm:
        rec["status"], rec["error"] = "error", "empty body"
    else:
        rec["status"] = "ok"


async def _lean_speech(pool, c: PointConfig, body: dict, rec: dict) -> float:
    """http_speech over bench/http1.py: the connection is taken from the pool (or opened) before dispatch."""
    import json

    from bench.http1 import Http1Error

    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if c.api_key:
        headers["Authorization"] = f"Bearer {c.api_key}"
    head = pool.request_head("POST", "/v1/audio/speech", headers, payload)
    chunks, pcm = [], bytearray()
    try:
        conn = await pool.acquire()
    except OSError as e:
        rec["status"], rec["error"] = "error", repr(e)
        return now()
    t_d = now()
    try:
        conn.send(head, payload)
        resp = await conn.response_head()
        rec["http_status"] = resp.status
        if resp.status != 200:
            _http_failure(rec, resp.status, await resp.read())
            return t_d
        async for piece in resp.pieces():
            chunks.append((now(), len(piece)))
            pcm += piece
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, Http1Error, ValueError) as e:
        rec["status"], rec["error"] = "error", repr(e)
        return t_d
    finally:
        pool.release(conn)  # kept only after a whole response; a failure or a cancel closes it
    _speech_result(rec, t_d, chunks, pcm)
    return t_d


@dataclass
class _State:
    in_flight: int = 0
    peak: int = 0
    pending_measured: int = 0
    users_active: int = 0
    lags: list = field(default_factory=list)


class PointRun:
    def __init__(self, cfg: PointConfig, shard: int = 0, start_wall: float | None = None):
        """shard: with cfg.procs > 1, which arrivals this process sends (those with i % procs == shard);
        start_wall: the point's start on the wall clock (time.time()) that every shard shares; None: now."""
        self.cfg = cfg
        self.shard, self.start_wall = shard, start_wall
        self.records: list[dict] = []
        self.st = _State()
        self.all_measured_done = asyncio.Event()
        self.http = None
        self.pool = None
        self.frames_per_word = 0
        self.sessions_opened = 0
        self.t_start = 0.0
        # the server's /metrics when the measured window starts and ends (text, or why the scrape failed)
        self.scrapes: dict[str, str | Exception] = {}

    # ---- bookkeeping -------------------------------------------------------------------------------------
    def phase(self, offset: float) -> str:
        c = self.cfg
        if offset < c.warmup:
            return "warmup"
        return "measured" if offset < c.warmup + c.window else "cooldown"

    async def arrive(self, offset: float) -> str | None:
        """Wait for an arrival time; its phase, or None once arrivals stop (cooldown off, or every measured
        request has ended)."""
        ph = self.phase(offset)
        if ph == "cooldown":
            if not self.cfg.cooldown or await wait_event(self.all_measured_done, self.t_start + offset - now()):
                return None
        else:
            await sleep_until(self.t_start + offset)
        return ph

    @property
    def window_bounds(self) -> tuple[float, float]:
        a = self.t_start + self.cfg.warmup
        return a, a + self.cfg.window

    def new_record(self, rid, text: str, offset: float, phase: str, **extra) -> dict:
        rec = {"id": rid, "phase": phase, "status": "pending", "scheduled_s": offset, "words": len(text.split()),
               "prompt": PROMPT_INDEX.get(text), **extra}
        self.records.append(rec)
        return rec

    def _note(self) -> None:
        a, b = self.window_bounds
        if a <= now() < b:
            self.st.peak = max(self.st.peak, self.st.in_flight)

    def _begin(self, rec: dict) -> None:
        self.st.in_flight += 1
        if rec["phase"] == "measured":
            self.st.pending_measured += 1
        self._note()

    def _end(self, rec: dict) -> None:
        self.st.in_flight -= 1
        self._note()
        if rec["phase"] == "measured":
            self.st.pending_measured -= 1
        self._check_done()

    def _check_done(self) -> None:
        if self.st.pending_measured == 0 and now() >= self.window_bounds[1]:
            self.all_measured_done.set()

    def _dispatched(self, rec: dict, t_d: float) -> None:
        rec["dispatch_s"] = t_d - self.t_start
        rec["dispatch_lag_ms"] = (t_d - self.t_start - rec["scheduled_s"]) * 1e3

    async def _monitor(self) -> None:
        a, b = self.window_bounds
        while True:
            t = now()
            await asyncio.sleep(0.005)
            t2 = now()
            if a <= t < b:
                self.st.lags.append(t2 - t - 0.005)
            self._check_done()

    async def _scrape_window(self) -> None:
        """The server's /metrics at the window's start and end: its first-audio histograms over the window."""
        for name, at in zip(("start", "end"), self.window_bounds, strict=True):
            await sleep_until(at)
            self.scrapes[name] = await server_first_audio.scrape(self.cfg.url)

    # ---- W1 ------------------------------------------------------------------------------------------------
    async def w1(self, rec: dict, text: str) -> None:
        t_d = await http_speech(self.http, self.cfg, text, rec)
        self._dispatched(rec, t_d)

    # ---- WebSocket helpers ---------------------------------------------------------------------------------
    def _ws_result(self, rec: dict, ctx, t_d: float, t_cancel: float | None = None) -> None:
        packets, end = [], 0
        gaps = 0
        for t, _seq, start, nbytes, _flags in ctx.packets:
            n = nbytes // 2
            if n and start != end:
                gaps += 1
            packets.append(metrics.Packet(t, start, n))
            end = max(end, start + n) if n else end
        samples = np.zeros(end, dtype=np.int16)
        offset = 0
        for p in packets:  # place each payload at its start_sample (ctx.pcm is their concatenation)
            samples[p.start : p.start + p.n] = np.frombuffer(ctx.pcm, dtype="<i2", count=p.n, offset=offset * 2)
            offset += p.n
        last = ctx.last_flag_at or (ctx.packets[-1][0] if ctx.packets else None) or ctx.ended_at
        rec.update(metrics.request_metrics(t_d, packets, samples, last_byte=last, until=t_cancel))
        rec["timeline_gaps"] = gaps
        if ctx.ended_at is not None:
            rec["end_ms"] = (ctx.ended_at - t_d) * 1e3
        if ctx.done:
            rec["done_reason"] = ctx.done.get("reason")
            rec["server_ttfa_ms"] = ctx.done.get("ttfa_ms")
        if ctx.error:
            code = ctx.error.get("code")
            rec["status"] = "refused" if code in ("overloaded", "context_limit") else "error"
            rec["error"] = f"{code}: {ctx.error.get('message', '')}"[:300]
        elif ctx.done and ctx.done.get("reason") in ("error", "timeout"):
            rec["status"], rec["error"] = "error", f"context.done reason {ctx.done.get('reason')}"
        elif ctx.cancelled is not None and t_cancel is not None:
            rec["status"] = "cancelled"
            rec["e2e_ms"] = None
            after = [(t, nb) for t, _s, _st, nb, _f in ctx.packets if t > t_cancel]
            rec["cancel_to_ack_ms"] = (ctx.ended_at - t_cancel) * 1e3
            rec["cancel_to_last_audio_ms"] = (max(t for t, _ in after) - t_cancel) * 1e3 if after else 0.0
            rec["audio_after_cancel_ms"] = sum(nb // 2 for _, nb in after) / metrics.SAMPLE_RATE * 1e3
        elif ctx.done is None:
            rec["status"], rec["error"] = "timeout", "no context.done"
        elif rec.get("first_playable_ms") is None:
            rec["status"], rec["error"] = "error", "no audio"
        else:
            rec["status"] = "ok"
        if rec["status"] not in ("ok", "cancelled"):
            rec["e2e_ms"] = None  # a failed request has no E2E (it enters the percentiles as +inf)

    async def _send_pieces(self, s, cid: str, pieces: list[str], t_d: float, interval: float, ctx) -> None:
        for k, piece in enumerate(pieces):
            if ctx.finished.is_set():
                return
            await sleep_until(t_d + k * interval)
            await s.send({"type": "text", "context_id": cid, "text": piece})
        if not ctx.finished.is_set():
            await sleep_until(t_d + len(pieces) * interval)
            await s.send({"type": "context.close", "context_id": cid})

    def _create_msg(self, cid: str) -> dict:
        c = self.cfg
        return {"type": "context.create", "context_id": cid, "voice": c.voice, "language": c.language,
                "output_format": "pcm_24000"}

    # ---- W2 ------------------------------------------------------------------------------------------------
    async def w2(self, rec: dict, text: str) -> None:
        c = self.cfg
        try:
            s = await self.pool.acquire()
        except Exception as e:
            rec["status"], rec["error"] = "error", f"connect: {e!r}"
            return
        cid = f"r{rec['id']}"
        ctx = s.open_context(cid)
        t_d = None
        try:
            await s.send(self._create_msg(cid))
            t_d = now()
            self._dispatched(rec, t_d)
            pieces = [w + " " for w in text.split()]
            await self._send_pieces(s, cid, pieces, t_d, c.word_interval, ctx)
            if not await wait_event(ctx.finished, t_d + c.request_timeout - now()):
                await _cancel_quietly(s, cid)
        except Exception as e:
            rec["status"], rec["error"] = "error", repr(e)
        finally:
            s.forget(cid)
            self.pool.release(s)
        if t_d is not None and rec["status"] == "pending":
            self._ws_result(rec, ctx, t_d)

    # ---- W3 ------------------------------------------------------------------------------------------------
    async def w3_user(self, uid: int, offset: float, plan: list[dict]) -> None:
        from voicelane_client.recorder import RecordingSession

        c = self.cfg
        self.st.users_active += 1
        try:
            try:
                s = await RecordingSession.open(ws_url(c.url), c.api_key)
                self.sessions_opened += 1
            except Exception as e:
                t = now() - self.t_start
                rec = self.new_record(f"u{uid}t0", plan[0]["text"], t, self.phase(t), user=uid, turn=0,
                                      prompts=plan[0]["prompts"])
                rec["status"], rec["error"] = "error", f"connect: {e!r}"
                return
            try:
                for turn, p in enumerate(plan):
                    if now() >= self.window_bounds[1] and self.all_measured_done.is_set():
                        break
                    end = await self._w3_reply(s, uid, turn, p)
                    await sleep_until(end + p["pause"])
                    if s.closed.is_set():
                        break
            finally:
                await s.close()
        finally:
            self.st.users_active -= 1

    async def _w3_reply(self, s, uid: int, turn: int, p: dict) -> float:
        c = self.cfg
        cid = f"u{uid}t{turn}"
        ctx = s.open_context(cid)
        await s.send(self._create_msg(cid))
        t_d = now()
        off = t_d - self.t_start
        rec = self.new_record(cid, p["text"], off, self.phase(off), user=uid, turn=turn, prompts=p["prompts"],
                              tokens_per_s=p["rate"], barge_in_planned=p["cancel"])
        self._dispatched(rec, t_d)
        rec["scheduled_s"] = off  # replies are paced by the conversation, not by the schedule
        rec["dispatch_lag_ms"] = 0.0
        self._begin(rec)
        t_cancel = None
        sender = asyncio.ensure_future(self._send_pieces(s, cid, llm_pieces(p["text"]), t_d, 1.0 / p["rate"], ctx))
        try:
            deadline = t_d + c.request_timeout
            if p["cancel"]:
                await wait_any([ctx.first_audio, ctx.finished], deadline - now())
                if ctx.first_audio.is_set() and not ctx.finished.is_set():
                    fp = next(t for t, _s, _st, nb, _f in ctx.packets if nb >= 2)
                    fpw = self.frames_per_word or s.frames_per_word
                    expected = rec["words"] * (fpw * FRAME_S if fpw else 0.4)
                    if not await wait_event(ctx.finished, fp + p["frac"] * expected - now()):
                        sender.cancel()
                        t_cancel = now()
                        await s.send({"type": "context.cancel", "context_id": cid,
                                      "played_ms": int((t_cancel - fp) * 1e3)})
                        rec["cancel_at_ms"] = (t_cancel - t_d) * 1e3
            if not await wait_event(ctx.finished, deadline - now()):
                await _cancel_quietly(s, cid)
        except Exception as e:
            rec["status"], rec["error"] = "error", repr(e)
        finally:
            sender.cancel()
            try:
                await sender
            except BaseException:
                pass
            s.forget(cid)
        if rec["status"] == "pending":
            self._ws_result(rec, ctx, t_d, t_cancel)
        self._end(rec)
        if t_cancel is not None:
            return t_cancel
        if rec.get("first_playable_ms") is None:
            return now()
        return t_d + (rec["first_playable_ms"] + rec["audio_ms"] + rec["stall_ms"]) / 1e3

    # ---- driver --------------------------------------------------------------------------------------------
    async def _guarded(self, fn, rec: dict, text: str) -> None:
        """One request; `_begin(rec)` was called when it arrived (so a measured request is pending at once)."""
        try:
            await asyncio.wait_for(fn(rec, text), self.cfg.request_timeout + 10)
        except asyncio.TimeoutError:
            rec["status"], rec["error"] = "timeout", "request timeout"
        except asyncio.CancelledError:  # the run ended: drain time over, or cool-down load no longer needed
            if rec["phase"] == "measured":
                rec["status"], rec["error"] = "timeout", "still running at the end of the drain time"
            else:
                rec["status"] = "aborted"
            raise
        except Exception as e:
            rec["status"], rec["error"] = "error", repr(e)
        finally:
            if rec["status"] == "pending":
                rec["status"], rec["error"] = "error", "unfinished"
            self._end(rec)

    async def run(self) -> dict:
        c = self.cfg
        if c.workload not in ("w1", "w2", "w3"):
            raise ValueError(f"unknown workload {c.workload!r}")
        horizon = c.warmup + c.window + c.drain_timeout
        tasks: set[asyncio.Task] = set()
        if c.workload == "w1":
            self.http = new_http_client(c.request_timeout, c.http_client, c.url)
        elif c.workload == "w2":
            from voicelane_client.recorder import SessionPool

            self.pool = SessionPool(ws_url(c.url), c.contexts_per_socket, c.api_key)
        self.t_start = now() + (0.1 if self.start_wall is None else self.start_wall - time.time())
        monitor = asyncio.ensure_future(self._monitor())
        # in a sharded point the parent process scrapes the server, once
        scraper = asyncio.ensure_future(self._scrape_window() if c.procs <= 1 else asyncio.sleep(0))
        try:
            if c.workload == "w3":
                await self._drive_w3(horizon, tasks)
            else:
                await self._drive(horizon, tasks, self.w1 if c.workload == "w1" else self.w2)
            # the schedule is over (or every measured request ended): wait for what is left, within the drain time
            await wait_event(self.all_measured_done, self.t_start + horizon - now())
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.wait({scraper}, timeout=max(0.0, self.window_bounds[1] - now()) + 10.0)
        finally:
            monitor.cancel()
            scraper.cancel()
            if self.http is not None:
                await self.http.aclose()
            if self.pool is not None:
                self.sessions_opened += self.pool.opened
                await self.pool.close()
        for r in self.records:
            if r["status"] == "pending":
                if r["phase"] == "measured":
                    r["status"], r["error"] = "timeout", "still running at the end of the drain time"
                else:  # warm-up or cool-down load, stopped when the measured requests had all ended
                    r["status"] = "aborted"
        return self.result()

    async def _drive(self, horizon: float, tasks: set, fn) -> None:
        c = self.cfg
        sched = make_schedule(c.arrival, c.rps, horizon, c.seed)
        prompts = PromptStream(c.seed, c.sentences())
        for i, off in enumerate(sched):
            text = prompts.next()
            if i % c.procs != self.shard:
                continue
            ph = await self.arrive(float(off))
            if ph is None:
                break
            rec = self.new_record(i, text, float(off), ph)
            if self.st.in_flight >= c.max_in_flight:
                rec["status"], rec["error"] = "client_cap", f"{self.st.in_flight} requests in flight"
                continue
            self._begin(rec)
            task = asyncio.ensure_future(self._guarded(fn, rec, text))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _drive_w3(self, horizon: float, tasks: set) -> None:
        c = self.cfg
        sched = make_schedule(c.arrival, c.rps / max(1, c.turns), horizon, c.seed)
        prompts = PromptStream(c.seed, c.sentences())
        g = rng(c.seed, STREAM_WORKLOAD)
        lo, hi = c.sentences_per_reply
        for u, off in enumerate(sched):
            plan = []
            for _ in range(c.turns):
                n = int(g.integers(lo, hi + 1))
                sents = [prompts.next() for _ in range(n)]
                plan.append({"text": " ".join(sents), "prompts": [PROMPT_INDEX.get(x) for x in sents],
                             "rate": float(g.uniform(*c.tokens_per_s)), "cancel": bool(g.random() < c.barge_in),
                             "frac": float(g.random()), "pause": float(g.uniform(*c.pause_s))})
            if u % c.procs != self.shard:
                continue
            ph = await self.arrive(float(off))
            if ph is None:
                break
            if self.st.users_active >= c.max_in_flight:
                for turn, p in enumerate(plan):
                    rec = self.new_record(f"u{u}t{turn}", p["text"], float(off), ph, user=u, turn=turn,
                                          prompts=p["prompts"])
                    rec["status"], rec["error"] = "client_cap", f"{self.st.users_active} users active"
                continue
            task = asyncio.ensure_future(self.w3_user(u, float(off), plan))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    def result(self) -> dict:
        c = self.cfg
        measured = [r for r in self.records if r["phase"] == "measured"]
        summary = metrics.summarize(measured, c.window, c.slo_ttfa_ms)
        summary["peak_in_flight"] = self.st.peak
        lags = np.asarray(self.st.lags) * 1e3
        disp = [r["dispatch_lag_ms"] for r in measured if r.get("dispatch_lag_ms") is not None]
        client = {
            "loop_lag_ms": {"p50": float(np.percentile(lags, 50)) if lags.size else math.nan,
                            "p99": float(np.percentile(lags, 99)) if lags.size else math.nan,
                            "max": float(lags.max()) if lags.size else math.nan},
            "dispatch_lag_ms": {**metrics.percentiles(disp, (50, 99)), "max": max(disp) if disp else math.nan},
            "processes": 1,  # client processes that sent the arrivals (a sharded point sets its own count)
            "sessions_opened": self.sessions_opened,
            "requests_total": len(self.records),
            "requests_by_phase": {ph: sum(1 for r in self.records if r["phase"] == ph)
                                  for ph in ("warmup", "measured", "cooldown")},
        }
        out = {"config": asdict(c), "summary": summary, "client": client,
               "server_first_audio": server_first_audio.window_breakdown(
                   self.scrapes.get("start"), self.scrapes.get("end"), c.workload,
                   server_first_audio.client_ttfa(measured))}
        if c.workload == "w3":
            cancelled = [r for r in measured if r["status"] == "cancelled"]
            out["barge_in"] = {
                "replies": len(measured), "cancelled": len(cancelled),
                "cancel_to_last_audio_ms": metrics.percentiles([r["cancel_to_last_audio_ms"] for r in cancelled]),
                "cancel_to_ack_ms": metrics.percentiles([r["cancel_to_ack_ms"] for r in cancelled]),
                "audio_after_cancel_ms": metrics.percentiles([r["audio_after_cancel_ms"] for r in cancelled]),
            }
        if c.records == "all":
            out["requests"] = self.records
        elif c.records == "measured":
            out["requests"] = measured
        return out


async def run_point(cfg: PointConfig, frames_per_word: int = 0) -> dict:
    if cfg.procs > 1:
        return await _run_sharded(cfg, frames_per_word)
    run = PointRun(cfg)
    run.frames_per_word = frames_per_word
    return await run.run()


SHARD_START_S = 3.0  # from launching the client processes to the point's start: their imports and connections


def _run_shard(cfg: PointConfig, shard: int, start_wall: float, frames_per_word: int) -> dict:
    """One client process's share of a point (a ProcessPoolExecutor task): its records, loop lags and sockets."""
    run = PointRun(replace(cfg, records="all"), shard, start_wall)
    run.frames_per_word = frames_per_word
    run_loop(run.run())
    return {"records": run.records, "lags": run.st.lags, "sessions_opened": run.sessions_opened, "pid": os.getpid()}


async def _run_sharded(cfg: PointConfig, frames_per_word: int) -> dict:
    """A point sent by cfg.procs client processes that share one schedule and one start time; this process
    scrapes the server's /metrics around the window and merges their records into one report."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    merged = PointRun(cfg)
    start_wall = time.time() + SHARD_START_S
    merged.t_start = now() + SHARD_START_S
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(cfg.procs, mp_context=multiprocessing.get_context("spawn")) as pool:
        shards = [loop.run_in_executor(pool, _run_shard, cfg, k, start_wall, frames_per_word)
                  for k in range(cfg.procs)]
        scraper = asyncio.ensure_future(merged._scrape_window())
        parts = await asyncio.gather(*shards)
        await asyncio.wait({scraper}, timeout=max(0.0, merged.window_bounds[1] - now()) + 10.0)
        scraper.cancel()
    for part in parts:
        merged.records += part["records"]
        merged.st.lags += part["lags"]
        merged.sessions_opened += part["sessions_opened"]
    merged.records.sort(key=lambda r: (r["scheduled_s"], str(r["id"])))
    merged.st.peak = peak_in_flight(merged.records, cfg.warmup, cfg.warmup + cfg.window)
    out = merged.result()
    out["client"]["processes"] = len({part["pid"] for part in parts})
    return out


def peak_in_flight(records: list[dict], start_s: float, end_s: float) -> int:
    """The most requests open at once between start_s and end_s (seconds from the point's start), from each
    record's dispatch and end (its last byte, else its dispatch: a refused or failed request counts for an
    instant)."""
    events = []
    for r in records:
        if r.get("dispatch_s") is None:
            continue
        begin = r["dispatch_s"]
        end = begin + (r.get("e2e_ms") or 0.0) / 1e3
        if end >= start_s and begin < end_s:
            events += [(max(begin, start_s), 1), (end, -1)]
    peak = open_now = 0
    for _, step in sorted(events, key=lambda e: (e[0], -e[1])):
        open_now += step
        peak = max(peak, open_now)
    return peak


async def describe_server(args, srv) -> tuple[dict, int]:
    """The report's `server` section (probe plus how it was started) and its benchmark frames per word."""
    info = await probe_server(args.url, args.api_key)
    info.update(srv.info())
    return info, int((info.get("session") or {}).get("bench_frames_per_word") or 0)


async def probe_server(url: str, api_key: str | None = None) -> dict:
    """What the server says about itself (/ready, /v1/models, the WebSocket session.created); best effort."""
    from bench.serverproc import http_get_json

    info: dict = {"url": url}
    loop = asyncio.get_running_loop()
    for path in ("/ready", "/v1/models"):
        status, body = await loop.run_in_executor(None, http_get_json, url.rstrip("/") + path, 5.0)
        info[path] = body if status == 200 else {"status": status, "body": str(body)[:300]}
    try:
        from voicelane_client.recorder import RecordingSession

        s = await RecordingSession.open(ws_url(url), api_key, timeout=10)
        info["session"] = {k: s.hello.get(k) for k in ("protocol", "model", "limits", "defaults",
                                                       "bench_frames_per_word")}
        await s.close()
    except Exception as e:
        info["session"] = {"error": repr(e)}
    return info


def compare_to_baseline(summary: dict, baseline: dict) -> dict:
    """our / official ratios of the p50 and p95 latencies (the baseline's first audio is its whole utterance)."""
    b = baseline["points"][0]["summary"]["latency_ms"]
    out = {"baseline_commit": baseline.get("commit"), "baseline_gpu": baseline.get("gpu")}
    for key in metrics.LATENCY_KEYS:
        for q in ("p50", "p95"):
            ours, theirs = summary["latency_ms"][key][q], b[key][q]
            out[f"{key}_{q}_ratio"] = ours / theirs if theirs and math.isfinite(theirs) else math.nan
    return out


def run_loop(coro):
    """asyncio.run, on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def point_line(p: dict) -> str:
    c, s = p["config"], p["summary"]
    lat = s["latency_ms"]
    return (f"{c['workload']} {c['rps']:g} rps: offered {s['offered']} ok {s['ok']} errors {s['errors']} | "
            f"audible TTFA p50/p95/p99 {fmt_ms(lat['audible_ttfa_ms']['p50'])}/"
            f"{fmt_ms(lat['audible_ttfa_ms']['p95'])}/{fmt_ms(lat['audible_ttfa_ms']['p99'])} ms | "
            f"first playable p95 {fmt_ms(lat['first_playable_ms']['p95'])} | E2E p50 {fmt_ms(lat['e2e_ms']['p50'])} | "
            f"underrun req {s['underrun_requests']} stall {s['total_stall_ms']:.0f} ms | peak {s['peak_in_flight']} | "
            f"achieved {s['achieved_rps']:.2f} rps | SLO {'PASS' if s['slo']['pass'] else 'fail'}")


def add_common_args(ap: argparse.ArgumentParser) -> None:
    d = PointConfig()
    ap.add_argument("--url", default=d.url, help="server base URL")
    ap.add_argument("--workload", choices=("w1", "w2", "w3"), default=d.workload)
    ap.add_argument("--arrival", choices=("poisson", "constant"), default=d.arrival)
    ap.add_argument("--warmup", type=float, default=d.warmup, help="seconds of load before the window")
    ap.add_argument("--window", type=float, default=d.window, help="measured window, seconds")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--max-in-flight", type=int, default=d.max_in_flight)
    ap.add_argument("--drain-timeout", type=float, default=d.drain_timeout)
    ap.add_argument("--request-timeout", type=float, default=d.request_timeout)
    ap.add_argument("--model", default=d.model)
    ap.add_argument("--voice", default=d.voice)
    ap.add_argument("--language", default=d.language)
    ap.add_argument("--word-interval", type=float, default=d.word_interval, help="W2: seconds between words")
    ap.add_argument("--contexts-per-socket", type=int, default=d.contexts_per_socket)
    ap.add_argument("--turns", type=int, default=d.turns, help="W3: replies per conversation")
    ap.add_argument("--barge-in", type=float, default=d.barge_in, help="W3: share of replies cancelled")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--slo-ttfa-ms", type=float, default=d.slo_ttfa_ms)
    ap.add_argument("--records", choices=("measured", "all", "none"), default=d.records)
    ap.add_argument("--no-cooldown", dest="cooldown", action="store_false",
                    help="stop the arrivals at the end of the window instead of until the measured requests end")
    ap.add_argument("--min-words", type=int, default=d.min_words, help="use only prompts with at least this many words")
    ap.add_argument("--max-words", type=int, default=d.max_words, help="... and at most this many")
    ap.add_argument("--http-client", choices=("lean", "httpx"), default=d.http_client,
                    help="W1's HTTP client (bench/http1.py says why lean is the default)")
    ap.add_argument("--procs", type=int, default=d.procs,
                    help="client processes sharing the arrivals (one event loop's lag stays out of the times)")
    ap.add_argument("--server-cmd", default=None,
                    help="start this server command first, wait for /ready, stop it at the end")
    ap.add_argument("--server-log", default=None, help="file for the spawned server's output")
    ap.add_argument("--server-ready-timeout", type=float, default=300.0)
    ap.add_argument("--baseline", default=None, help="a bench.baseline_official report: adds our/official ratios")


def config_from_args(args, rps: float) -> PointConfig:
    return PointConfig(url=args.url, workload=args.workload, rps=rps, arrival=args.arrival, warmup=args.warmup,
                       window=args.window, seed=args.seed, max_in_flight=args.max_in_flight,
                       drain_timeout=args.drain_timeout, request_timeout=args.request_timeout, model=args.model,
                       voice=args.voice, language=args.language, word_interval=args.word_interval,
                       contexts_per_socket=args.contexts_per_socket, turns=args.turns, barge_in=args.barge_in,
                       api_key=args.api_key, slo_ttfa_ms=args.slo_ttfa_ms, records=args.records,
                       cooldown=args.cooldown, min_words=args.min_words, max_words=args.max_words,
                       procs=args.procs, http_client=args.http_client)


class server_context:
    """`--server-cmd` support shared by the CLIs: a no-op when no command is given."""

    def __init__(self, args):
        self.args, self.proc = args, None

    def __enter__(self):
        if self.args.server_cmd:
            from bench.serverproc import ServerProcess

            self.proc = ServerProcess(self.args.server_cmd, self.args.url, self.args.server_ready_timeout,
                                      self.args.server_log).__enter__()
            print(f"server ready after {self.proc.startup_s:.1f}s", file=sys.stderr)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.__exit__(*exc)
        return False

    def info(self) -> dict:
        if self.proc is None:
            return {}
        return {"cmd": self.args.server_cmd, "startup_s": self.proc.startup_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--rps", type=float, nargs="+", required=True, help="target rate(s); several = several points")
    ap.add_argument("--out", required=True, help="JSON report path")
    args = ap.parse_args(argv)
    report = {"kind": "loadgen", **environment("bench.loadgen"), "points": []}
    baseline = load_report(args.baseline) if args.baseline else None
    with server_context(args) as srv:

        async def go():
            report["server"], fpw = await describe_server(args, srv)
            for rps in args.rps:
                p = await run_point(config_from_args(args, rps), fpw)
                if baseline is not None:
                    p["vs_official"] = compare_to_baseline(p["summary"], baseline)
                report["points"].append(p)
                print(point_line(p), file=sys.stderr)
                print(server_first_audio.table(p["server_first_audio"]), file=sys.stderr)
                write_report(report, args.out)

        run_loop(go())
    write_report(report, args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


async def _cancel_quietly(session, cid: str) -> None:
    """Give up on a context that outlived its time limit; the socket may already be gone."""
    try:
        await session.send({"type": "context.cancel", "context_id": cid})
    except Exception:  # noqa: BLE001 - best effort
        pass
