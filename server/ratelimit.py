"""Per-client request rate limit for HTTP speech requests: a token bucket per API key (or client address when
the server has no keys). Refusals are 429 `rate_limited` with Retry-After."""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict

MAX_CLIENTS = 10_000  # buckets kept; the least recently seen are forgotten first


class RateLimiter:
    def __init__(self, rps: float, burst: int, clock=time.monotonic):
        self.rps, self.burst, self.clock = rps, max(1, burst), clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, last time)

    @property
    def enabled(self) -> bool:
        return self.rps > 0

    @staticmethod
    def client_id(api_key: str | None, address: str | None) -> str:
        # Keys are hashed so the limiter never holds one in clear.
        if api_key:
            return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:16]
        return "addr:" + (address or "?")

    def acquire(self, client: str) -> float:
        """Take one request token: 0 if allowed, else the seconds until one is available."""
        if not self.enabled:
            return 0.0
        now = self.clock()
        tokens, last = self._buckets.pop(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rps)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rps
        self._buckets[client] = (tokens, now)
        while len(self._buckets) > MAX_CLIENTS:
            self._buckets.popitem(last=False)
        return wait

    @staticmethod
    def retry_after(wait: float) -> str:
        return str(max(1, math.ceil(wait)))
