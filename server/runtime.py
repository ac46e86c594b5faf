"""What one server process holds: configuration, the engine (once loaded), the tokenizer, the catalog of voices
and languages, metrics, the audio thread pool, auth, the open WebSocket sessions and the draining state.

The model loads on a background thread so /health answers at once; /ready turns 200 when the engine is warmed up
and running (and not draining).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

from engine import ModelInfo, SamplingParams, TextTokenizer
from server.auth import KeyChecker, OriginPolicy
from server.config import ServerConfig
from server.metrics import ServerMetrics
from server.options import Catalog, Defaults
from server.ratelimit import RateLimiter

if TYPE_CHECKING:
    from engine import Engine, RemoteEngine

log = logging.getLogger("voicelane.server")


class DrainableSession(Protocol):
    """What the runtime asks of an open WebSocket session (server.ws.session.WsSession; not imported, since that
    module imports this one)."""

    def on_drain(self, deadline_s: float) -> None: ...


PREFERRED_VOICE = "ryan"


class Runtime:
    def __init__(self, config: ServerConfig, engine: Engine | None = None, tokenizer: TextTokenizer | None = None):
        config.validate()
        self.config = config
        self.limits = config.limits
        self.metrics = ServerMetrics()
        self.keys = KeyChecker(config.api_keys)
        self.metrics_keys = KeyChecker(config.metrics_key)
        self.origins = OriginPolicy(config.allowed_origins, check_host=not self.keys.enabled)
        self.rate_limiter = RateLimiter(config.rate_limit_rps, config.rate_limit_burst)
        self.executor = ThreadPoolExecutor(max_workers=config.encode_threads, thread_name_prefix="voicelane-audio")
        self.sessions: set[DrainableSession] = set()
        self.http_streams = 0
        self.draining = False
        self.drain_deadline: float | None = None
        self.drain_expired = asyncio.Event()  # set at the drain deadline: HTTP streams still running are cut
        self.load_error: str | None = None
        self.loading = False
        self.started_at = time.time()
        self.engine: Engine | RemoteEngine | None = None
        self.tokenizer: TextTokenizer | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_load_failure = None  # called (on the loader thread) when the model cannot be loaded
        if engine is not None:
            self._install(engine, tokenizer)

    # ------------------------------------------------------------------ model
    def _install(self, engine: Engine | RemoteEngine, tokenizer: TextTokenizer | None) -> None:
        if tokenizer is None:
            if engine.loaded.tokenizer_dir is None:
                raise RuntimeError("the model has no tokenizer directory")
            tokenizer = TextTokenizer.from_dir(engine.loaded.tokenizer_dir)
        info = engine.info
        voices = tuple(v.name.lower() for v in info.voices)
        self.catalog = Catalog(voices, tuple(lang.lower() for lang in info.languages))
        default_voice = self.config.default_voice
        if default_voice is not None:
            default_voice = self.catalog.voice(default_voice, "default_voice")
        else:
            default_voice = PREFERRED_VOICE if PREFERRED_VOICE in voices else voices[0]
        self.defaults = Defaults(voice=default_voice)
        self.tokenizer = tokenizer
        self.engine = engine

    def load_in_background(self, build) -> None:
        """`build()` returns (engine, tokenizer) with the engine warmed up and started; runs on a thread."""
        self.loading = True
        self.loop = asyncio.get_running_loop()

        def run():
            try:
                engine, tokenizer = build()
                self.loop.call_soon_threadsafe(self._loaded, engine, tokenizer)
            except BaseException as exc:  # noqa: BLE001 - reported through /ready and the log
                log.exception("model loading failed")
                self.load_error = f"{type(exc).__name__}: {exc}"
                self.loading = False
                if self.on_load_failure is not None:
                    self.on_load_failure()

        threading.Thread(target=run, name="voicelane-load", daemon=True).start()

    def _loaded(self, engine: Engine | RemoteEngine, tokenizer: TextTokenizer) -> None:
        try:
            self._install(engine, tokenizer)
        except Exception as exc:  # noqa: BLE001
            log.exception("model install failed")
            self.load_error = f"{type(exc).__name__}: {exc}"
        self.loading = False
        if self.engine is not None:
            self.engine.attach(asyncio.get_running_loop())
            log.info("ready: model %s (%d voices, %s), serving on http://%s:%d", self.engine.info.name,
                     len(self.catalog.voices), "random weights" if self.engine.info.random_weights else "checkpoint",
                     self.config.host, self.config.port)

    @property
    def info(self) -> ModelInfo | None:
        return self.engine.info if self.engine is not None else None

    @property
    def sampling_base(self) -> SamplingParams:
        assert self.engine is not None
        return self.engine.sampling_defaults

    @property
    def max_frames(self) -> int:
        return self.config.engine.max_frames

    def engine_running(self) -> bool:
        return self.engine is not None and self.engine.running()

    def readiness(self) -> dict:
        r: dict = {"model_loaded": self.engine is not None, "loading": self.loading, "draining": self.draining}
        if self.load_error:
            r["load_error"] = self.load_error
        if self.engine is not None:
            r.update(self.engine.readiness().to_json())
            r["model"] = self.engine.info.name
        r["ready"] = bool(self.engine is not None and r.get("warmed_up") and r.get("engine_running")
                          and not self.draining)
        return r

    @staticmethod
    def draw_seed() -> int:
        return secrets.randbelow(2**31)

    # ------------------------------------------------------------------ draining
    def start_drain(self) -> None:
        """On the event loop: refuse new work, let work in flight finish until the deadline, then cut it (each
        WebSocket session at its next deadline check, each HTTP stream through `drain_expired`)."""
        if self.draining:
            return
        self.draining = True
        self.drain_deadline = time.monotonic() + self.config.drain_timeout_s
        if self.engine is not None:
            self.engine.end_pacing()  # what is in flight generates at full speed, to finish before the deadline
        log.info("draining: %d WebSocket session(s), %d HTTP stream(s) in flight; deadline %.0f s",
                 len(self.sessions), self.http_streams, self.config.drain_timeout_s)
        for s in list(self.sessions):
            s.on_drain(self.config.drain_timeout_s)
        asyncio.get_running_loop().call_later(self.config.drain_timeout_s, self._drain_deadline)

    def _drain_deadline(self) -> None:
        if self.http_streams or self.sessions:
            log.warning("drain deadline: cutting %d HTTP stream(s) and %d WebSocket session(s) still in flight",
                        self.http_streams, len(self.sessions))
        self.drain_expired.set()

    def drained(self) -> bool:
        return not self.sessions and self.http_streams == 0

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)
