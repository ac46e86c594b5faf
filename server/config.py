"""Server configuration: one frozen tree, resolved by the CLI, printed at start (never the keys)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from engine import EngineConfig


class ServerConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Limits:
    """Per-socket limits (docs/protocol.md 1, `session.created.limits`)."""

    max_contexts: int = 8
    max_text_chars_per_message: int = 4096
    max_text_chars_per_context: int = 100_000
    max_message_bytes: int = 65536
    idle_timeout_s: float = 60.0
    context_idle_timeout_s: float = 30.0
    max_unsent_audio_s: float = 10.0
    max_unsent_bytes: int = 8 << 20  # every outgoing byte queued for a client that does not read
    max_messages_per_s: float = 500.0  # client messages handled per second per socket; faster ones wait
    message_burst: int = 1000  # messages a socket may send at once before the rate applies

    def validate(self) -> None:
        _refuse([(getattr(self, n) < 1, f"{n} = {getattr(self, n)}; it must be >= 1 (--{n.replace('_', '-')})")
                 for n in ("max_contexts", "max_text_chars_per_message", "max_text_chars_per_context")])
        _refuse([
            (self.max_message_bytes < 1024, f"max_message_bytes = {self.max_message_bytes}; it must be >= 1024"),
            (self.max_unsent_bytes < 1 << 16, f"max_unsent_bytes = {self.max_unsent_bytes}; it must be >= 65536"),
            (self.max_messages_per_s < 0 or self.message_burst < 1, f"max_messages_per_s = {self.max_messages_per_s}, "
             f"message_burst = {self.message_burst}; use a rate >= 0 (0 = off) and a burst >= 1")])
        _refuse([(getattr(self, n) <= 0, f"{n} = {getattr(self, n)}; it must be > 0 (--{n.replace('_', '-')})")
                 for n in ("idle_timeout_s", "context_idle_timeout_s", "max_unsent_audio_s")])


def _refuse(rules: list[tuple[bool, str]]) -> None:
    """ServerConfigError with the message of the first rule whose condition (what is wrong) holds."""
    for wrong, message in rules:
        if wrong:
            raise ServerConfigError(message)


class Secret(tuple):
    """API keys: a tuple that never shows its contents in repr/str (so printing the config cannot leak them)."""

    def __repr__(self) -> str:
        return f"<{len(self)} key(s)>"

    __str__ = __repr__


@dataclass(frozen=True)
class ServerConfig:
    model: str = "tiny-random"  # checkpoint dir | tiny-random | random:1.7b | random:0.6b | random:tiny
    device: str = "cpu"
    dtype: str = "float32"
    host: str = "127.0.0.1"
    port: int = 8000
    limits: Limits = field(default_factory=Limits)
    engine: EngineConfig = field(default_factory=EngineConfig)
    api_keys: Secret = field(default_factory=Secret)
    metrics_key: Secret = field(default_factory=Secret)  # zero or one key
    allowed_origins: tuple[str, ...] = ()  # browser origins besides the server's own; "*" = any
    max_sessions: int = 0  # concurrent WebSocket sessions; 0 = unlimited
    default_voice: str | None = None
    random_seed: int = 0  # weights of random:* / tiny-random models
    cpu_threads: int = 0  # torch threads on the CPU; 0 = torch's default
    drain_timeout_s: float = 25.0
    http_max_body_bytes: int = 1 << 20
    http_head_timeout_s: float = 10.0  # a request head must be complete this long after it may start
    http_body_timeout_s: float = 30.0  # a request body must be complete this long after its head
    # an idle kept-alive HTTP connection is closed after this. Longer than clients' own pool expiry (httpx 5 s,
    # aiohttp 15 s): a server that closes first races the client's next request, which then fails unsent
    http_keepalive_s: float = 30.0
    max_connections_per_client: int = 256  # open HTTP connections per client address; 0 = unlimited
    rate_limit_rps: float = 0.0  # speech requests per second per API key (or client address); 0 = off
    rate_limit_burst: int = 10
    opus_complexity: int = 10
    encode_threads: int = 4
    # sys.setswitchinterval: how long a thread may hold the GIL while another waits for it. Python's 5 ms would let
    # the event loop hold back the engine thread (or the reverse) for a whole step; 0 = leave Python's
    gil_switch_interval_ms: float = 1.0
    test_hooks: bool = False  # fault injection through context.create (tests only)
    log_level: str = "info"
    warmup: bool = True
    engine_process: bool = False  # the engine in a process of its own (engine/remote.py), off the server's GIL

    def validate(self) -> None:
        self.limits.validate()
        self.engine.validate()
        _refuse([
            (not 0 < self.port < 65536, f"port = {self.port}; use 1..65535 (--port)"),
            (self.max_sessions < 0, f"max_sessions = {self.max_sessions}; use 0 (unlimited) or more"),
            (self.rate_limit_rps < 0 or self.rate_limit_burst < 1, f"rate_limit_rps = {self.rate_limit_rps}, "
             f"rate_limit_burst = {self.rate_limit_burst}; use rps >= 0 (0 = off) and burst >= 1"),
            (self.http_head_timeout_s <= 0 or self.http_body_timeout_s <= 0, "http_head_timeout_s = "
             f"{self.http_head_timeout_s}, http_body_timeout_s = {self.http_body_timeout_s}; both must be > 0"),
            (self.http_keepalive_s <= 0, f"http_keepalive_s = {self.http_keepalive_s}; must be > 0"),
            (self.max_connections_per_client < 0, f"max_connections_per_client = {self.max_connections_per_client}; "
             "use 0 (unlimited) or more"),
            (self.drain_timeout_s < 0, f"drain_timeout_s = {self.drain_timeout_s}; it must be >= 0"),
            (not 0 <= self.opus_complexity <= 10, f"opus_complexity = {self.opus_complexity}; use 0..10"),
            (self.cpu_threads < 0, f"cpu_threads = {self.cpu_threads}; use 0 (torch's default) or more"),
            (self.encode_threads < 1, f"encode_threads = {self.encode_threads}; it must be >= 1"),
            (self.gil_switch_interval_ms < 0, f"gil_switch_interval_ms = {self.gil_switch_interval_ms}; use 0 "
             "(Python's default) or milliseconds"),
            (len(self.metrics_key) > 1, "give at most one --metrics-key")])

    def describe(self) -> dict:
        """The resolved configuration for printing: keys are counted, never shown."""
        d = asdict(self)
        d["api_keys"] = f"{len(self.api_keys)} configured" if self.api_keys else "none (open server)"
        d["metrics_key"] = "set" if self.metrics_key else "none (/metrics open)"
        d["allowed_origins"] = list(self.allowed_origins) or ["(same origin only)"]
        return d
