"""A per-request timeline of what the engine did, exportable as a Chrome trace (chrome://tracing, Perfetto)."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict, deque


class Timeline:
    def __init__(self, capacity: int = 10000, origin: float = 0.0):
        self.events: deque[dict] = deque(maxlen=capacity)
        self.origin = origin
        # Bounded like the events: the ring never holds more contexts than events, and an unbounded map grew by
        # every context ever served (1M contexts made one export block for seconds under the engine's lock).
        self.capacity = max(1, capacity)
        self.trace_ids: OrderedDict[int, str] = OrderedDict()
        self._lock = threading.Lock()

    def _us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 1)

    def name_context(self, cid: int, trace_id: str) -> None:
        with self._lock:
            self.trace_ids[cid] = trace_id
            self.trace_ids.move_to_end(cid)
            while len(self.trace_ids) > self.capacity:
                self.trace_ids.popitem(last=False)

    def instant(self, cid: int, name: str, t: float, **args) -> None:
        """A milestone of one context (arrival, admitted, prefill, first audio, chunk, done ...)."""
        with self._lock:
            self.events.append({"name": name, "ph": "i", "s": "t", "pid": 1, "tid": cid, "ts": self._us(t),
                                "args": {"trace_id": self.trace_ids.get(cid, ""), **args}})

    def step(self, stage: str, start: float, seconds: float, rows: list[int]) -> None:
        """One engine iteration: a stage run over a batch (rows = context ids)."""
        with self._lock:
            self.events.append({"name": stage, "ph": "X", "pid": 0, "tid": 0, "ts": self._us(start),
                                "dur": round(seconds * 1e6, 1), "args": {"batch": len(rows), "contexts": rows}})

    def for_context(self, cid: int) -> list[dict]:
        with self._lock:
            return [e for e in self.events if e.get("tid") == cid and e["pid"] == 1]

    def chrome_trace(self) -> str:
        # copy under the lock, serialise outside it: the engine thread records events while this runs
        with self._lock:
            ids = list(self.trace_ids.items())
            events = list(self.events)
        names = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": cid, "args": {"name": f"ctx {cid} {tid}"}}
                 for cid, tid in ids]
        meta = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "engine steps"}},
                {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "contexts"}}]
        return json.dumps({"traceEvents": meta + names + events, "displayTimeUnit": "ms"})
