"""The engine loop, on its own thread: plan, launch, collect the previous step, update.

A step's results are read one iteration late, so the host never waits for the device inside a step; the
scheduler's state changes under one lock, held only for planning and bookkeeping, never during model work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.scheduler import Scheduler
from engine.trace import Timeline
from engine.types import EngineEvent, StageStats

if TYPE_CHECKING:  # the loop itself needs no torch: the simulator drives it with a simulated runner
    from engine.runner import Pending, Runner

log = logging.getLogger("voicelane.engine")


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
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.crashed: BaseException | None = None
        self.on_crash: Callable[[BaseException], None] | None = None
        self.last_plan = None

    def step(self) -> bool:
        if self.plan_lead_s and self.in_flight is not None and self.in_flight_end is not None:
            # Late planning: what arrives while the device runs its step still makes the next one.
            wait = self.in_flight_end - self.plan_lead_s - self.clock()
            if wait > 0:
                self.sleep(wait)
        with self.lock:
            plan = self.scheduler.plan(self.clock())
        self.last_plan = plan
        launched = self.runner.launch(plan) if plan is not None else None
        self._finish(self.in_flight)
        self.in_flight = launched
        self.in_flight_end = None
        if launched is not None and self.plan_lead_s:
            # The device starts it now: the step before has just been collected (or none was in flight).
            rows = plan.rows
            predicted = self.scheduler.costs.step_s(plan.stage, len(rows), max(max(r.chunk for r in rows), 1))
            if predicted is not None:
                self.in_flight_end = self.clock() + predicted
        return plan is not None

    def _wait(self, seconds: float) -> None:
        """Sleep, but wake at once for a call (a newcomer's text): planning it now is as early as it can run."""
        self.wake.clear()
        self.wake.wait(seconds)

    def _finish(self, pending: Pending | None) -> None:
        if pending is None:
            return
        result = self.runner.collect(pending)
        with self.lock:
            events = self.scheduler.update(result, self.clock())
        rows = [r.cid for r in pending.plan.rows]
        self.stage_stats.setdefault(result.stage.value, StageStats()).add(len(rows), result.elapsed_s)
        self.timeline.step(result.stage.value, pending.started, result.elapsed_s, rows)
        if events:
            self.deliver(events)

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Drive the loop on the caller's thread until nothing is runnable (tests, tools)."""
        for _ in range(max_steps):
            if not self.step() and self.in_flight is None:
                return
        raise RuntimeError(f"engine still busy after {max_steps} steps")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="voicelane-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.step() and self.in_flight is None:
                    self.wake.wait(0.05)
                    self.wake.clear()
        except BaseException as exc:  # noqa: BLE001 - reported through /ready and the log
            self.crashed = exc
            plan = self.last_plan
            log.exception("engine loop crashed: every open context ends with an internal error (last step: %s %s)",
                          plan.stage.value if plan else None,
                          [(r.cid, r.slot, r.frame, r.chunk) for r in plan.rows] if plan else [])
            if self.on_crash is not None:
                self.on_crash(exc)

    def stop(self) -> None:
        self._stop.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

