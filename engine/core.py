"""The engine loop, on its own thread: plan, launch, collect the previous step, update.

A step's results are read one iteration late, so the host never waits for the device inside a step; the
scheduler's state changes under one lock, held only for planning and bookkeeping, never during model work.

With two lanes (SchedulerConfig.first_audio_lane) each lane is such a pipeline of its own on its own device stream:
the first-audio lane (newcomers) and the main lane (playing streams). The loop then never blocks on one lane's
step: it plans whatever a lane can take, collects whatever the device has finished, and otherwise waits for the
earliest predicted end or for a call (a newcomer's text), whichever comes first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.scheduler import Scheduler
from engine.trace import Timeline
from engine.types import EngineEvent, LoopStats, Stage, StageStats

if TYPE_CHECKING:  # the loop itself needs no torch: the simulator drives it with a simulated runner
    from engine.runner import Pending, Runner

log = logging.getLogger("voicelane.engine")
POLL_S = 0.0002  # a step past its predicted end: look again this often (a wait that any call cuts short)


def carries_first_audio(plan) -> bool:
    """Does this step make a segment's first audio (a chained first step, or a codec step with a first chunk)?"""
    return plan.stage == Stage.FIRST_AUDIO or (plan.stage == Stage.CODEC and any(r.frame == 0 for r in plan.rows))


@dataclass
class Lane:
    """One pipeline of steps on the device: at most two launched and not yet collected, oldest first."""

    name: str  # "first" (the first-audio lane) or "main"
    queue: deque = field(default_factory=deque)  # Pending
    ends: deque = field(default_factory=deque)  # predicted device end of each queued step (None: not measured)
    launched: int = 0  # steps launched on this lane so far


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: Runner, deliver: Callable[[list[EngineEvent]], None],
                 timeline: Timeline, clock: Callable[[], float] = time.monotonic, plan_lead_s: float = 0.0,
                 sleep: Callable[[float], None] | None = None):
        self.scheduler, self.runner, self.deliver, self.timeline, self.clock = (
            scheduler, runner, deliver, timeline, clock)
        self.plan_lead_s = plan_lead_s  # 0: plan as soon as the step before is collected (synchronous runners)
        self.sleep = sleep or self._wait
        self.in_flight_end: float | None = None  # predicted device end of the step in flight
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.in_flight: Pending | None = None
        self.stage_stats: dict[str, StageStats] = {}  # stage name -> cumulative counters
        self.loop_stats = LoopStats()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.crashed: BaseException | None = None
        self.on_crash: Callable[[BaseException], None] | None = None
        self.last_plan = None
        self.lanes = [Lane("first"), Lane("main")] if scheduler.cfg.first_audio_lane else []
        self._collected_at = 0.0  # when the last collect returned (the device had finished that step by then)

    @property
    def busy(self) -> bool:
        """Is any step launched and not yet collected?"""
        return self.in_flight is not None or any(lane.queue for lane in self.lanes)

    def step(self) -> bool:
        if self.lanes:
            return self._step_lanes()
        if self.scheduler.cfg.collect_first_audio_at_once and self.in_flight is not None \
                and carries_first_audio(self.in_flight.plan):
            # Its listener waits for this step: hand its audio over before the host plans and launches the next
            # one (the device idles for that long, about a millisecond per newcomer).
            self._finish(self.in_flight)
            self.in_flight, self.in_flight_end = None, None
        if self.plan_lead_s and self.in_flight is not None and self.in_flight_end is not None:
            # Late planning: what arrives while the device runs its step still makes the next one.
            wait = self.in_flight_end - self.plan_lead_s - self.clock()
            if wait > 0:
                self.sleep(wait)
        planning_at = self.clock()
        with self.lock:
            plan = self.scheduler.plan(planning_at)
        self.last_plan = plan
        launched_at = self.clock()
        launched = self.runner.launch(plan) if plan is not None else None
        self._count_host(planning_at, launched is not None)
        behind = self.in_flight is not None
        self._finish(self.in_flight)
        self.in_flight = launched
        self.in_flight_end = None
        if launched is not None and self.plan_lead_s:
            # The step's measured time runs from its launch's start on an idle device (the host's enqueueing
            # counts) and from the end of the step before it otherwise, which the collect just waited for.
            start = max(launched_at, self._collected_at) if behind else launched_at
            predicted = self._predicted_s(plan)
            if predicted is not None:
                self.in_flight_end = start + predicted
        return plan is not None

    def _predicted_s(self, plan) -> float | None:
        return self.scheduler.costs.step_s(plan.stage, len(plan.rows), max(r.chunk for r in plan.rows) or 1)

    def _step_lanes(self) -> bool:
        """One pass over the lanes: plan and launch what each can take (the first-audio lane first, at once; the
        main lane plan_lead_s before its queued step ends), collect what the device has finished, else wait."""
        self.wake.clear()  # a call from here on cuts the wait below short
        progressed = False
        for lane in self.lanes:
            if len(lane.queue) >= 2:
                continue
            if lane.name == "main" and lane.queue and self.plan_lead_s and lane.ends[-1] is not None \
                    and lane.ends[-1] - self.plan_lead_s > self.clock():
                continue  # late planning, as with one lane
            planning_at = self.clock()
            with self.lock:
                plan = self.scheduler.plan(planning_at, lane.name)
            if plan is None:
                continue
            self.last_plan = plan
            launched_at = self.clock()
            lane.queue.append(self.runner.launch(plan))
            self._count_host(planning_at, True)
            lane.launched += 1
            predicted = self._predicted_s(plan)
            start = launched_at if len(lane.queue) == 1 or lane.ends[-1] is None else max(launched_at, lane.ends[-1])
            lane.ends.append(None if predicted is None else start + predicted)
            progressed = True
        for lane in self.lanes:
            if lane.queue and self.runner.ready(lane.queue[0]):
                lane.ends.popleft()
                self._finish(lane.queue.popleft())
                progressed = True
        if progressed or not self.busy:
            return progressed
        now = self.clock()
        moments = [lane.ends[0] for lane in self.lanes if lane.queue and lane.ends[0] is not None]
        main = self.lanes[-1]
        if len(main.queue) == 1 and main.ends[0] is not None and self.plan_lead_s:
            moments.append(main.ends[0] - self.plan_lead_s)
        self.wait_for_call(max(min(moments, default=now) - now, POLL_S))
        return True

    def wait_for_call(self, seconds: float) -> None:
        """Wait this long, or less if a call (a newcomer's text, a cancel) comes in meanwhile."""
        if self.sleep is self._wait:
            self.wake.wait(seconds)
        else:
            self.sleep(seconds)

    def _wait(self, seconds: float) -> None:
        """Sleep, but wake at once for a call (a newcomer's text): planning it now is as early as it can run."""
        self.wake.clear()
        self.wake.wait(seconds)

    def _count_host(self, since: float, launched: bool) -> None:
        """The engine thread's own time since `since` (planning, and the launch if one was made) counts as host."""
        self.loop_stats.host_s += self.clock() - since
        self.loop_stats.iterations += launched

    def _finish(self, pending: Pending | None) -> None:
        if pending is None:
            return
        result = self.runner.collect(pending)
        self._collected_at = self.clock()
        with self.lock:
            events = self.scheduler.update(result, self._collected_at)
        rows = [r.cid for r in pending.plan.rows]
        self.stage_stats.setdefault(result.stage.value, StageStats()).add(len(rows), result.elapsed_s)
        if result.idle_before_s is not None:
            self.loop_stats.add_idle(result.idle_before_s)
        self.timeline.step(result.stage.value, pending.started, result.elapsed_s, rows)
        if events:
            self.deliver(events)
        self._count_host(self._collected_at, False)  # the bookkeeping after the collect's wait

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Drive the loop on the caller's thread until nothing is runnable (tests, tools)."""
        for _ in range(max_steps):
            if not self.step() and not self.busy:
                return
        raise RuntimeError(f"engine still busy after {max_steps} steps")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="voicelane-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.step() and not self.busy:
                    self.wake.wait(self._idle_wait_s())
                    self.wake.clear()
        except BaseException as exc:  # noqa: BLE001 - reported through /ready and the log
            self.crashed = exc
            plan = self.last_plan
            log.exception("engine loop crashed: every open context ends with an internal error (last step: %s %s)",
                          plan.stage.value if plan else None,
                          [(r.cid, r.slot, r.frame, r.chunk) for r in plan.rows] if plan else [])
            if self.on_crash is not None:
                self.on_crash(exc)

    def _idle_wait_s(self) -> float:
        """Nothing to run: wait for a call, or until pacing's hold ends (Scheduler.held_until), at most 50 ms."""
        held = self.scheduler.held_until
        return 0.05 if held is None else min(0.05, max(held - self.clock(), POLL_S))

    def stop(self) -> None:
        self._stop.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

