"""The scheduling policy: every iteration, one stage and a batch of the requests waiting at it.

Plain Python, no torch, clock passed in. The policy (docs/engine.md, Policy):
  1. Classes: a request whose listener waits for its first audible audio (a newcomer) runs ahead of playing
     streams, first come first served, until the consumer reports the audible onset; a playing stream goes
     ahead of the newcomers only when its predicted slack would fall below the newcomers' first-audio chain
     plus its own next chunk. A playing stream is otherwise urgent once the listener's buffer would run dry
     within the safety lead (client acks, else 1x from the first send). Policy "edf" (the one before) puts
     both on one deadline axis: a newcomer's deadline is its arrival.
  2. Anchor and fill: the most urgent runnable request picks the stage; the batch is filled with other requests
     waiting there (by class, then deadline) up to the stage's limit. A codec step is padded to the anchor's
     chunk: requests whose own chunk is no larger join it (each decodes its own frames), larger ones wait.
  3. Nothing urgent: run the stage with the most waiting work (throughput mode), building slack; a codec step
     there is padded to the largest waiting chunk, so it holds every codec-runnable request. With pacing
     (pace_buffer_s) at light load: nothing at all while every runnable stream is real-time and its listener has
     that much buffered (held_until says until when).
  4. Admission refuses what the cost model predicts cannot be served without hurting playing streams, and a
     newcomer whose own predicted first audio is too late.
  5. With first_audio_chain, a segment's prefill is a FIRST_AUDIO step: the prefill, frame 0's codes and its
     1-frame audio in one launch, counted at plan time as all three steps (their results come back together).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque

import numpy as np

from engine.config import SchedulerConfig
from engine.cost_model import CostModel
from engine.model.config import ModelConfig
from engine.model.prompt import Voice, build_prompt, text_track_id
from engine.model.sampling_params import SamplingParams
from engine.request import FRAME_S, ContextState, Request
from engine.types import (
    AudioChunk,
    ContextDone,
    EngineEvent,
    RowPlan,
    SchedulerStats,
    SegmentDone,
    Stage,
    StagePlan,
    StageResult,
)

log = logging.getLogger("voicelane.scheduler")
SAMPLE_RATE = 24000
STARVATION_S = 1.0  # a runnable request not served for this long is treated as urgent
# Throughput mode breaks ties towards finishing work already in flight.
FIRST_AUDIO_PARTS = ("prefill", "code_predictor", "codec")  # the stages on a segment's way to its first audio
STAGE_ORDER = (Stage.CODEC, Stage.CODE_PREDICTOR, Stage.TALKER, Stage.PREFILL, Stage.FIRST_AUDIO)
# Rank classes (Scheduler._rank): a playing stream about to run dry (or starving), a newcomer, another urgent
# playing stream, nothing urgent.
URGENT, NEWCOMER, PLAYING_URGENT, NOT_URGENT = 0, 1, 2, 3


class AdmissionRefused(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, model_cfg: ModelConfig, timeline=None):
        cfg.validate()
        self.cfg, self.model_cfg = cfg, model_cfg
        self.costs = CostModel({**cfg.max_batch, Stage.FIRST_AUDIO.value: cfg.max_batch[Stage.PREFILL.value]})
        self.timeline = timeline
        self.contexts: dict[int, ContextState] = {}
        self.segments: dict[int, deque[Request]] = {}  # per context: head is the active segment
        self.requests: dict[int, Request] = {}  # rid -> live request
        self.free_slots = list(range(cfg.slots - 1, -1, -1))
        self._ids = itertools.count(1)
        self._last_served: dict[int, float] = {}
        # Predicted length of the last step planned: the device holds it when the next plan is made, and
        # nothing planned then starts before it ends.
        self._in_flight_s = 0.0
        self.outbox: list[EngineEvent] = []  # events not yet handed to the engine, in order
        self.chain_gave_way: str | None = None  # first_audio_chain on but not chaining now: why
        self.held_until: float | None = None  # pacing held every runnable stream at the last plan: until then
        self.pacing = cfg.pace_buffer_s > 0  # off for good once the server drains (end_pacing)

    # ------------------------------------------------------------------ context operations
    def open_context(self, voice: Voice, sampling: SamplingParams, now: float, *, layout: str = "dual",
                     instruction: list[int] | None = None, reports_onset: bool = False,
                     realtime: bool = False) -> int:
        """Admit a context (AdmissionRefused if not). `instruction`: the wrapped instruction's ids;
        `reports_onset`: the consumer calls mark_audible per segment (the server's silence trimmer); `realtime`:
        it plays the audio at 1x as it comes, so pacing may hold it."""
        self._check_admission(now)
        cid = next(self._ids)
        self.contexts[cid] = ContextState(cid=cid, slot=self.free_slots.pop(), sampling=sampling, voice=voice,
                                          layout=layout, instruction=instruction, reports_onset=reports_onset,
                                          realtime=realtime)
        self.segments[cid] = deque()
        self._trace(cid, "admitted", now)
        return cid

    def _check_admission(self, now: float) -> None:
        if not self.free_slots:
            raise AdmissionRefused(f"all {self.cfg.slots} slots are in use")
        waiting = sum(1 for r in self._heads() if r.first_audio_at is None and r.text_ids)
        if waiting >= self.cfg.max_waiting_first_audio:
            raise AdmissionRefused(f"{waiting} requests are already waiting for their first audio")
        if not self.contexts:
            return  # nothing is playing that a new stream could hurt (and refusing would never teach the costs)
        streams = len(self.contexts) + 1
        predicted = self.costs.round_s(streams, self.cfg.chunk_ramp[-1])
        if predicted is not None and predicted > self.cfg.admission_load * FRAME_S:
            raise AdmissionRefused(f"predicted {predicted * 1e3:.1f} ms per 80 ms of audio for {streams} streams")
        limit = self.cfg.admission_first_audio_s
        if limit and self.cfg.policy == "first_audio":
            first = self.predicted_first_audio_s(now)
            if first is not None and first > limit:
                raise AdmissionRefused(f"predicted first audio in {first * 1e3:.0f} ms (limit {limit * 1e3:.0f} ms)")

    def predicted_first_audio_s(self, now: float) -> float | None:
        """When a request arriving now would deliver its first audio: the step the device already holds, the
        playing streams that would run dry first (one round covers them all, so the longest of them counts), then
        the newcomers' chain with everyone already waiting batched in. None before the costs are measured."""
        heads = list(self._heads())
        waiting = sum(1 for r in heads if self.in_first_audio_class(r))
        chain = self._newcomer_chain_s(waiting + 1)
        if chain is None:
            return None
        ahead = 0.0
        for r in heads:
            if not self.in_first_audio_class(r) and r.generating and self._at_risk(r, now, chain, len(heads)):
                ahead = max(ahead, self._next_chunk_s(r, len(heads)) or 0.0)
        return self._in_flight_s + ahead + chain

    def _tail(self, cid: int, now: float) -> Request:
        """The segment that new text goes to (created when the last one is complete)."""
        queue, ctx = self.segments[cid], self.contexts[cid]
        if queue and not queue[-1].text_complete:
            return queue[-1]
        seg = ctx.segments_started
        ctx.segments_started += 1
        sampling = ctx.sampling.with_overrides(seed=(ctx.sampling.seed + seg) % 2**63)
        req = Request(rid=next(self._ids), context=ctx, segment=seg, arrival=now, layout=ctx.layout,
                      sampling=sampling)
        queue.append(req)
        self.requests[req.rid] = req
        return req

    def append_text(self, cid: int, ids: list[int], now: float) -> None:
        if not ids or cid not in self.contexts:
            return
        req = self._tail(cid, now)
        if not req.text_ids:
            req.arrival = now  # time to first audio counts from the segment's first text
            empty = self.contexts[cid].clock.buffer_empty_at()
            # A later segment while the listener still plays the one before is continuation, not first audio.
            req.newcomer = empty is None or empty <= now
            self._trace(cid, "first_text", now, segment=req.segment)
        req.text_ids.extend(ids)

    def end_segment(self, cid: int, words: int | None, now: float, close: bool = False) -> int | None:
        """Flush (or close): the text so far is a complete segment. Returns its index, None if it had no text."""
        ctx = self.contexts.get(cid)
        if ctx is None:
            return None
        queue = self.segments[cid]
        ended = None
        if queue and not queue[-1].text_complete:
            req = queue[-1]
            if req.text_ids:
                req.text_complete, req.words = True, words
                ended = req.segment
                self._apply_bench_length(req)
            else:
                queue.pop()  # an empty open segment: nothing to say
                del self.requests[req.rid]
                ctx.segments_started -= 1
        if close:
            ctx.closed = True
            self._finish_context_if_idle(ctx, now)
        return ended

    def cancel(self, cid: int, now: float) -> None:
        ctx = self.contexts.get(cid)
        if ctx is None:
            return
        ctx.cancelled = True
        self._end_context(ctx, "cancelled", now)

    def playback(self, cid: int, played_ms: float, state: str, buffered_ms: float | None, now: float) -> None:
        ctx = self.contexts.get(cid)
        if ctx is not None:
            clock = ctx.clock
            clock.ack_at, clock.ack_played_s, clock.ack_state = now, played_ms / 1000.0, state
            clock.ack_buffered_s = None if buffered_ms is None else buffered_ms / 1000.0
            clock.ack_delivered_s, clock.ack_trimmed_s = clock.delivered_s, clock.trimmed_s

    def mark_audible(self, cid: int, segment: int, trimmed_s: float, now: float) -> None:
        """The consumer's silence trimmer found the segment's audible onset, after dropping `trimmed_s` of its
        leading silence: the segment leaves the first-audio class, and the playback clock learns that the listener
        never gets that silence and (for the context's first audible audio) starts playing only now."""
        ctx = self.contexts.get(cid)
        if ctx is not None:
            ctx.clock.trimmed_s += trimmed_s
            if ctx.clock.audible_sent_at is None:
                ctx.clock.audible_sent_at = now
        for r in self.segments.get(cid, ()):
            if r.segment == segment and r.audible_at is None:
                r.audible_at = now
                self._trace(cid, "audible", now, segment=segment)

    def fail(self, cid: int, message: str, now: float) -> None:
        ctx = self.contexts.get(cid)
        if ctx is not None:
            ctx.failed = message
            self._end_context(ctx, "error", now, error=message)

    # ------------------------------------------------------------------ planning
    def _heads(self):
        for queue in self.segments.values():
            if queue:
                yield queue[0]

    def generation_stage(self, r: Request) -> Stage | None:
        if r.done or not r.generating:
            return None
        if not r.prefilled:
            ready = bool(r.text_ids) and (r.text_complete or r.layout == "dual")
            if not ready:
                return None
            return self.generation_start()
        if r.frames_made < r.code0_made:
            return Stage.CODE_PREDICTOR
        s = r.frames_made - 1
        if text_track_id(self.model_cfg, r.text_ids, s, r.layout, r.text_complete) is None:
            return None  # text-starved: never read padding before the text ends
        return Stage.TALKER

    def codec_chunk(self, r: Request) -> int:
        pending = r.confirmed_frames() - r.frames_decoded
        want = self.cfg.chunk_ramp[min(r.chunks, len(self.cfg.chunk_ramp) - 1)]
        if pending >= want:
            return want
        final = r.stop_at is not None and r.confirmed_frames() == r.stop_at and r.code0_checked >= r.code0_made
        return pending if final and pending > 0 else 0

    def deadline(self, r: Request, now: float) -> float:
        """When this request must next make progress: its arrival until its context plays audio, then the moment
        the listener's buffer would run dry minus the safety lead. Starving requests age into urgency."""
        empty = r.context.clock.buffer_empty_at()
        d = r.arrival if empty is None else empty - self.cfg.safety_lead_s
        served = self._last_served.get(r.rid, r.arrival)
        return min(d, served + STARVATION_S)

    def in_first_audio_class(self, r: Request) -> bool:
        """Does the listener wait for this request's first audible audio? Until the consumer reports the onset
        (a silent first chunk must not end the class); for a consumer that reports none, until the first chunk;
        and never past first_audio_max_s of audio, so a lost report cannot hold a stream ahead of all others."""
        if not r.newcomer or r.audible_at is not None:
            return False
        if r.first_audio_at is None:
            return True
        return r.context.reports_onset and r.frames_emitted * FRAME_S < self.cfg.first_audio_max_s

    def chaining(self) -> bool:
        """Does a segment start with one FIRST_AUDIO step? With first_audio_chain, while that step (one row) is
        predicted within max_step_s: everything that arrives meanwhile waits for it whole, so a longer chain (a slow
        GPU, a large model) runs as three steps that urgent work can come between. Unmeasured: chain."""
        if not self.cfg.first_audio_chain:
            return False
        chain = self.costs.step_s(Stage.FIRST_AUDIO, 1)
        if chain is None:  # measured as three steps so far (or not at all)
            chain = self._newcomer_chain_s(1, Stage.PREFILL)
        chaining = chain is None or not self.cfg.max_step_s or chain <= self.cfg.max_step_s
        if chaining == (self.chain_gave_way is not None):  # it changed: said in the log and in /ready
            if chaining:
                log.info("first-audio chain back on (predicted %s)",
                         "nothing: costs unmeasured" if chain is None else f"{chain * 1e3:.1f} ms")
                self.chain_gave_way = None
            else:
                self.chain_gave_way = (f"gave way to three steps: the chain is predicted {chain * 1e3:.1f} ms, over "
                                       f"max_step_s {self.cfg.max_step_s * 1e3:.0f} ms")
                log.warning("first-audio chain %s", self.chain_gave_way)
        return chaining

    def _newcomer_chain_s(self, n: int, start: Stage | None = None) -> float | None:
        """Device time from a newcomer's prefill to its first audio, n newcomers batched (None: not measured), as
        one FIRST_AUDIO step or as three (`start`: the first stage of the newcomers; None: as they run now)."""
        if (start or self.generation_start()) == Stage.FIRST_AUDIO:
            return self.costs.rows_s(Stage.FIRST_AUDIO, n)
        parts = (self.costs.rows_s(Stage.PREFILL, n), self.costs.rows_s(Stage.CODE_PREDICTOR, n),
                 self.costs.rows_s(Stage.CODEC, n, 1))
        return None if any(p is None for p in parts) else sum(parts)

    def generation_start(self) -> Stage:
        """The first step of a segment: FIRST_AUDIO while chaining, else PREFILL."""
        return Stage.FIRST_AUDIO if self.chaining() else Stage.PREFILL

    def _next_chunk_s(self, r: Request, streams: int) -> float | None:
        """Device time until a playing stream's next codec chunk exists: the frames it still lacks (a Talker and
        a Code Predictor step each, batched with the other streams), then the chunk's codec step."""
        want = self.cfg.chunk_ramp[min(r.chunks, len(self.cfg.chunk_ramp) - 1)]
        if r.stop_at is not None:
            want = min(want, r.stop_at - r.frames_decoded)
        if want <= 0:
            return 0.0
        missing = max(0, want - (r.frames_made - r.frames_decoded))
        talker, cp = self.costs.rows_s(Stage.TALKER, streams), self.costs.rows_s(Stage.CODE_PREDICTOR, streams)
        codec = self.costs.rows_s(Stage.CODEC, streams, want)
        if talker is None or cp is None or codec is None:
            # With the chain on, the Code Predictor and the codec are measured apart only once streams play; until
            # then a frame costs what the chain does (a 1-position prefill is a Talker step's work).
            chain = self.costs.rows_s(Stage.FIRST_AUDIO, streams) if self.chaining() else None
            return None if chain is None else max(missing, 1) * chain
        return missing * (talker + cp) + codec

    def _at_risk(self, r: Request, now: float, chain: float | None, streams: int) -> bool:
        """Would this playing stream run dry if the newcomers' chain ran first? Slack below the chain, its own
        next chunk and the step the device already holds says yes; before anything is measured, the safety lead
        decides (the edf rule). Audio of codec steps already planned counts as delivered: it arrives one step
        late, long before the rest of the chunk after it could be made."""
        empty = r.context.clock.buffer_empty_at()
        if empty is None:
            return False
        empty += (r.frames_decoded - r.frames_emitted) * FRAME_S
        nxt = self._next_chunk_s(r, streams)
        if chain is None or nxt is None:
            return empty - self.cfg.safety_lead_s <= now
        return empty - now < chain + nxt + self._in_flight_s

    def lane_of(self, r: Request, stage: Stage) -> str:
        """Two lanes: a request's steps run on the first-audio lane while it is in the first-audio class, and every
        prefill does (the prompt-prefix cache is then touched by one lane only); the rest on the main lane."""
        return "first" if stage in (Stage.PREFILL, Stage.FIRST_AUDIO) or self.in_first_audio_class(r) else "main"

    def plan(self, now: float, lane: str | None = None) -> StagePlan | None:
        """The next step; with `lane` ("first" or "main"), the next step of that lane only (lane_of)."""
        runnable: list[tuple[Request, Stage, int, tuple]] = []  # request, stage, codec chunk, rank
        if lane != "first":
            self.held_until = None
        heads = list(self._heads())
        newcomers = [] if self.cfg.policy == "edf" else [r for r in heads if self.in_first_audio_class(r)]
        chain = self._newcomer_chain_s(len(newcomers)) if newcomers else None
        for r in heads:
            rank = self._rank(r, now, newcomers, chain, len(heads))
            chunk = self.codec_chunk(r)
            if chunk and (lane is None or self.lane_of(r, Stage.CODEC) == lane):
                runnable.append((r, Stage.CODEC, chunk, rank))
            stage = self.generation_stage(r)
            if stage is not None and (lane is None or self.lane_of(r, stage) == lane):
                runnable.append((r, stage, 0, rank))
        if not runnable:
            return None
        urgent = [x for x in runnable if x[3][0] < NOT_URGENT]
        if urgent:
            # The anchor's most useful next stage: audio if it can make some, else generation.
            anchor = min(urgent, key=lambda x: (x[3], x[1] != Stage.CODEC))
            stage, chunk = anchor[1], anchor[2]
        else:
            held = self._paced_until(runnable, now) if lane != "first" else None
            self.held_until = held
            if held is not None:
                return None
            stage, chunk = self._throughput_stage(runnable)
        # A codec step is padded to `chunk` frames: every row whose own chunk fits rides along (decoding its own).
        members = [x for x in runnable if x[1] == stage and (stage != Stage.CODEC or x[2] == chunk
                                                             or (self.cfg.mix_codec_chunks and x[2] < chunk))]
        members.sort(key=lambda x: x[3])
        limit = self.costs.max_batch[stage.value]
        if lane == "first":
            limit = min(limit, self.cfg.first_lane_max_batch)
        size = self._step_rows(stage, chunk, min(len(members), limit))
        batch = members[:size]
        padded = max(x[2] for x in batch)  # the anchor's chunk (0 outside the codec)
        if lane != "first":  # the step a newcomer's prediction counts as in flight: the main (or only) lane's
            self._in_flight_s = self.costs.step_s(stage, len(batch), max(padded, 1)) or 0.0
        rows = [self._advance(r, stage, own, now) for r, _, own, _ in batch]
        for r, *_ in batch:
            self._last_served[r.rid] = now
        wait_lane = None
        if lane is not None:
            if any(r.context.lane not in (None, lane) for r, *_ in batch):
                wait_lane = "main" if lane == "first" else "first"
            for r, *_ in batch:
                r.context.lane = lane
        return StagePlan(stage, rows, lane, wait_lane)

    def _paced_until(self, runnable, now: float) -> float | None:
        """Pacing (SchedulerConfig.pace_buffer_s): with at most pace_max_contexts open, when every runnable stream
        plays in real time and its listener has at least pace_buffer_s buffered, the moment the first of them drops
        to it; else None. One stream that must run takes the others along: their rows cost the step almost nothing."""
        cfg = self.cfg
        if not self.pacing or len(self.contexts) > (cfg.pace_max_contexts or cfg.slots // 2):
            return None
        until = float("inf")
        for r, *_ in runnable:
            empty = r.context.clock.buffer_empty_at()
            if empty is None or not r.context.realtime:
                return None
            until = min(until, empty - cfg.pace_buffer_s)
        return until if until > now else None

    def _rank(self, r: Request, now: float, newcomers: list[Request], chain: float | None, streams: int) -> tuple:
        """(class, time): lower runs first. Without newcomers (or under edf) every urgent request shares one
        deadline axis; with newcomers, playing streams at risk of running dry come first, then the newcomers in
        arrival order, then other urgent playing streams, then (NOT_URGENT) the rest by deadline."""
        d = self.deadline(r, now)
        if not newcomers:
            return (URGENT if d <= now else NOT_URGENT, d)
        if self.in_first_audio_class(r):
            return (NEWCOMER, r.first_audio_at is not None, r.arrival)
        if r.generating or self.codec_chunk(r):
            if self._at_risk(r, now, chain, streams):
                return (URGENT, d)
        starving = self._last_served.get(r.rid, r.arrival) + STARVATION_S <= now
        if starving:
            return (URGENT, d)
        return (PLAYING_URGENT if d <= now else NOT_URGENT, d)

    def _step_rows(self, stage: Stage, chunk: int, rows: int) -> int:
        """The largest batch (at least one row) whose predicted step fits max_step_s: a request that arrives
        now waits for the step in flight before its prefill, so long steps (the codec's largest chunks at large
        batches) become its latency; the rest of the batch runs in the next steps."""
        limit, frames = self.cfg.max_step_s, max(chunk, 1)
        single = self.costs.step_s(stage, 1, frames)
        if not limit or single is None or single > limit:
            return rows  # nothing measured yet, or even one row is too long: splitting would only lose batching
        lo, hi = 1, rows  # the fit grows with the batch: binary search for the largest batch within the limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.costs.step_s(stage, mid, frames) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _throughput_stage(self, runnable) -> tuple[Stage, int]:
        """The stage with the most runnable rows (a codec step padded to the largest waiting chunk holds every
        codec row)."""
        groups: dict[Stage, list[int]] = {}
        for _, stage, chunk, _ in runnable:
            groups.setdefault(stage, []).append(chunk)
        stage = max(groups, key=lambda k: (len(groups[k]), -STAGE_ORDER.index(k)))
        return stage, max(groups[stage])

    def _eos_allowed(self, r: Request, code0_index: int) -> bool:
        return code0_index >= r.sampling.min_frames and not self.cfg.bench_frames_per_word

    def _advance(self, r: Request, stage: Stage, chunk: int, now: float) -> RowPlan:
        if stage == Stage.FIRST_AUDIO:  # the three steps' bookkeeping, in their order; one row carries all three
            row = self._advance(r, Stage.PREFILL, 0, now)
            self._advance(r, Stage.CODE_PREDICTOR, 0, now)
            self._advance(r, Stage.CODEC, 1, now)
            return RowPlan(row.rid, row.cid, row.slot, 0, prompt=row.prompt, sampling=row.sampling,
                           eos_allowed=row.eos_allowed, chunk=1)
        if stage == Stage.PREFILL:
            text = r.text_ids if r.layout == "whole" else r.text_ids[:1]
            r.prompt = build_prompt(self.model_cfg, r.context.voice, text, r.layout, r.context.instruction)
            r.prefilled, r.code0_made, r.prefill_planned_at = True, 1, now
            self._trace(r.context.cid, "prefill", now, segment=r.segment)
            return RowPlan(r.rid, r.context.cid, r.slot, 0, prompt=r.prompt, sampling=r.sampling,
                           eos_allowed=self._eos_allowed(r, 0))
        if stage == Stage.CODE_PREDICTOR:
            s = r.frames_made
            r.frames_made += 1
            if r.frames_made >= r.sampling.max_frames:
                self._stop(r, r.frames_made, "max_frames")
            self._apply_bench_length(r)
            return RowPlan(r.rid, r.context.cid, r.slot, s)
        if stage == Stage.TALKER:
            s = r.frames_made - 1
            text_id = text_track_id(self.model_cfg, r.text_ids, s, r.layout, r.text_complete)
            r.code0_made += 1
            return RowPlan(r.rid, r.context.cid, r.slot, s, text_id=text_id, eos_allowed=self._eos_allowed(r, s + 1))
        first = r.frames_decoded
        r.frames_decoded += chunk
        r.chunks += 1
        return RowPlan(r.rid, r.context.cid, r.slot, first, chunk=chunk)

    def _stop(self, r: Request, frames: int, reason: str) -> None:
        if r.stop_at is None or frames < r.stop_at:
            r.stop_at, r.finish_reason = frames, reason

    def _apply_bench_length(self, r: Request) -> None:
        """Benchmark length mode: a complete segment ends after exactly N x words frames (at once if past)."""
        n = self.cfg.bench_frames_per_word
        if n and r.text_complete and r.words is not None and r.generating and r.frames_made >= max(n * r.words, 1):
            self._stop(r, r.frames_made, "completed")

    # ------------------------------------------------------------------ results
    def update(self, result: StageResult, now: float) -> list[EngineEvent]:
        chunks = [len(c) for c in result.codes or () if c is not None]  # codec: frames per row of this step
        frames = max(chunks, default=1)  # a step with rows of several chunk sizes costs its largest (padded)
        self.costs.observe(result.stage, len(result.rids), result.elapsed_s, frames)
        for i, rid in enumerate(result.rids):
            r = self.requests.get(rid)
            if r is None or r.done:
                continue  # cancelled or failed since the step was planned
            if result.failed and result.failed[i]:
                self.fail(r.context.cid, result.failed[i], now)
                continue
            if r.first_audio_at is None and result.device_spans:
                self._note_first_audio_spans(r, result)
            if result.eos is not None:
                if result.eos[i] and r.eos_at is None:
                    r.eos_at = r.code0_checked
                    self._stop(r, r.eos_at, "completed")
                r.code0_checked += 1
            if result.pcm is not None and (r.stop_at is None or r.frames_emitted < r.stop_at):
                # (a FIRST_AUDIO row whose code 0 was EOS decoded a frame the segment does not have)
                self._emit_audio(r, result.pcm[i], result.codes[i], now)
        for r in [h for h in self._heads() if h.stop_at is not None]:
            self._finish_segment_if_done(r, now)
        out, self.outbox = self.outbox, []
        return out

    @staticmethod
    def _note_first_audio_spans(r: Request, result: StageResult) -> None:
        """Keep where the device ran this request's steps toward its first audio: the first of each stage is the
        one on that path (its prefill, frame 0's Code Predictor, its first codec chunk: steps are collected in
        launch order)."""
        for stage, span in result.device_spans.items():
            if stage in FIRST_AUDIO_PARTS:
                r.first_audio_spans.setdefault(stage, span)
        if result.stage in (Stage.PREFILL, Stage.FIRST_AUDIO) and r.ahead_of_prefill_done is None:
            r.ahead_of_prefill_done = result.ahead_done

    def _emit_audio(self, r: Request, pcm, codes, now: float) -> None:
        ctx = r.context
        frames = codes.shape[0]
        first = r.first_audio_at is None
        self.outbox.append(AudioChunk(pcm=np.asarray(pcm, dtype=np.float32), start_sample=ctx.audio_samples,
                                      segment=r.segment, first_frame=r.frames_emitted, codes=np.asarray(codes),
                                      cid=ctx.cid, first_audio=r.first_audio_times(now) if first else None))
        if first:
            r.first_audio_at = now
            self._trace(ctx.cid, "first_audio", now, segment=r.segment)
        r.frames_emitted += frames
        ctx.audio_samples += len(pcm)
        ctx.clock.delivered_s += len(pcm) / SAMPLE_RATE
        if ctx.clock.first_sent_at is None:
            ctx.clock.first_sent_at = now

    def _finish_segment_if_done(self, r: Request, now: float) -> None:
        if r.code0_checked < r.code0_made and r.eos_at is None:
            return  # an EOS flag is still in flight: it could shorten the segment
        if r.frames_emitted < r.stop_at:
            return
        r.done = True
        ctx = r.context
        self.segments[ctx.cid].popleft()
        self.requests.pop(r.rid, None)
        self._last_served.pop(r.rid, None)
        ctx.last_reason = r.finish_reason
        self.outbox.append(SegmentDone(r.segment, r.finish_reason, frames=r.stop_at, end_sample=ctx.audio_samples,
                                       cid=ctx.cid))
        self._trace(ctx.cid, "segment_done", now, segment=r.segment)
        self._finish_context_if_idle(ctx, now)

    def _finish_context_if_idle(self, ctx: ContextState, now: float) -> None:
        if ctx.closed and not self.segments[ctx.cid]:
            self._end_context(ctx, ctx.last_reason, now)

    def _end_context(self, ctx: ContextState, reason: str, now: float, error: str | None = None) -> None:
        for r in self.segments.pop(ctx.cid, ()):
            r.done = True
            self.requests.pop(r.rid, None)
            self._last_served.pop(r.rid, None)
        del self.contexts[ctx.cid]
        self.free_slots.append(ctx.slot)
        code = "synthesis_failed" if reason == "error" else None
        self.outbox.append(ContextDone(reason, ctx.audio_samples, error_code=code, error_message=error, cid=ctx.cid))
        self._trace(ctx.cid, "done", now, reason=reason)

    def drain_outbox(self) -> list[EngineEvent]:
        out, self.outbox = self.outbox, []
        return out

    # ------------------------------------------------------------------ introspection
    def stats(self) -> SchedulerStats:
        heads = list(self._heads())
        waiting = {s.value: 0 for s in Stage}
        for r in heads:
            st = self.generation_stage(r)
            if st is not None:
                waiting[st.value] += 1
            if self.codec_chunk(r):
                waiting[Stage.CODEC.value] += 1
        return SchedulerStats(
            contexts=len(self.contexts), requests=len(self.requests), free_slots=len(self.free_slots),
            waiting_first_audio=sum(1 for r in heads if r.first_audio_at is None and r.text_ids),
            text_starved=sum(1 for r in heads if r.prefilled and r.generating and
                             self.generation_stage(r) is None and not self.codec_chunk(r)),
            queue_depth=waiting, pacing=self.pacing)

    def _trace(self, cid: int, name: str, now: float, **args) -> None:
        if self.timeline is not None:
            self.timeline.instant(cid, name, now, **args)
