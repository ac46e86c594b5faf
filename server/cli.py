"""`voicelane serve ...` (also `python -m server serve ...`): parse flags, print the resolved configuration (never
the keys), load the model on a thread while uvicorn already answers /health, serve.

SIGTERM / SIGINT drain: `session.draining` to every WebSocket, new contexts and requests refused, work in flight
finishes (up to --drain-timeout-s), sockets close with 1001, then the process exits. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import fields, replace

from engine import (
    MAX_SLOTS,
    RANDOM_NOTICE,
    RANDOM_SIZES,
    TINY_RANDOM,
    EngineConfig,
    RemoteEngine,
    SchedulerConfig,
    TextTokenizer,
    is_random,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_dtype_name,
    set_cpu_threads,
)
from server.auth import keys_from_env, read_key_file
from server.config import Limits, Secret, ServerConfig, ServerConfigError
from server.logs import setup_logging

log = logging.getLogger("voicelane.server")
LIMIT_HELP = {"max_unsent_bytes": "bytes of messages and audio queued for a client that does not read; over it: 4009",
              "max_messages_per_s": "client messages handled per second per socket (0 = off); a faster client is paced",
              "message_burst": "messages a socket may send at once before --max-messages-per-s applies"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="voicelane", description="Real-time TTS server for Qwen3-TTS")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the server", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    eng = SchedulerConfig()
    g = s.add_argument_group("model")
    g.add_argument("--model", default="tiny-random",
                   help="checkpoint directory, tiny-random (small random model, made once into the cache folder), "
                        "random:1.7b or random:0.6b (random weights built in memory)")
    g.add_argument("--device", default="auto", help="cuda, cuda:N, cpu, or auto (cuda when available)")
    g.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16, "
                                                   "float32")
    g.add_argument("--seed", type=int, default=0, help="weights seed of random models")
    g.add_argument("--cpu-threads", type=int, default=0, help="torch threads on the CPU (0: torch's default; 1 suits "
                   "the tiny model and machines shared with other work)")
    g.add_argument("--default-voice", default=None, help="voice of contexts that name none (default: ryan)")
    g = s.add_argument_group("network")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g = s.add_argument_group("auth")
    g.add_argument("--api-key", action="append", default=[], help="an accepted API key (repeatable); also "
                   "--api-key-file and $VOICELANE_API_KEYS (comma-separated)")
    g.add_argument("--api-key-file", action="append", default=[], help="file with one API key per line")
    g.add_argument("--metrics-key", default=None, help="key /metrics asks for (Bearer); default: /metrics is open")
    g.add_argument("--allowed-origins", action="append", default=[],
                   help="browser origins allowed besides the server's own, comma-separated; * allows any")
    g.add_argument("--max-sessions", type=int, default=0, help="concurrent WebSocket sessions (0 = unlimited)")
    g.add_argument("--rate-limit-rps", type=float, default=0.0,
                   help="HTTP speech requests per second per API key or client address (0 = off); over it: 429")
    g.add_argument("--rate-limit-burst", type=int, default=10, help="requests a client may send at once")
    g.add_argument("--http-head-timeout-s", type=float, default=10.0,
                   help="a request head must arrive whole within this (slow-loris guard); else the connection closes")
    g.add_argument("--http-keepalive-s", type=float, default=ServerConfig.http_keepalive_s,
                   help="an idle kept-alive HTTP connection closes after this; keep it above your clients' pool "
                        "expiry (httpx 5 s, aiohttp 15 s), or a request sent as the server closes is lost")
    g.add_argument("--http-body-timeout-s", type=float, default=30.0,
                   help="a request body must arrive whole within this after its head; else 408 request_timeout")
    g.add_argument("--max-connections-per-client", type=int, default=256,
                   help="open HTTP connections per client address (0 = unlimited; behind a proxy every client "
                        "shares its address: raise it or use 0)")
    g = s.add_argument_group("per-socket limits")
    for f in fields(Limits):  # --max-contexts ... --message-burst: one flag per field, the field's default
        g.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                       help=LIMIT_HELP.get(f.name))
    g = s.add_argument_group("engine")
    g.add_argument("--max-frames", type=int, default=EngineConfig().max_frames,
                   help="frames a segment may return (sizes the KV cache)")
    g.add_argument("--max-prompt-tokens", type=int, default=EngineConfig().max_prompt_tokens)
    g.add_argument("--max-slots", type=int, default=eng.max_slots,
                   help="concurrent segment requests (KV cache rows); 0 = auto: as many as the device's free memory "
                        f"holds beside a reserve, at most {MAX_SLOTS} (64 on a CPU)")
    g.add_argument("--prefix-cache-entries", type=int, default=EngineConfig().prefix_cache_entries,
                   help="prompt prefixes (voice, language, instruction) whose keys and values stay on the device, so "
                        "a newcomer's prefill runs only its text positions; least recently used out first; 0 = off")
    g.add_argument("--prefix-cache-mib", type=float, default=EngineConfig().prefix_cache_mib,
                   help="device memory the prefix cache may hold; 0 = off")
    g.add_argument("--bench-frames-per-word", type=int, default=None,
                   help="benchmark length mode: N frames per word (docs/protocol.md 1.6); 0 = off. Default: 5 for "
                        "random weights (they never end an utterance by themselves), off for checkpoints")
    g.add_argument("--admission-load", type=float, default=eng.admission_load)
    g.add_argument("--admission-first-audio-ms", type=float, default=eng.admission_first_audio_s * 1e3,
                   help="refuse a request whose predicted first audio is later than this; 0 = off")
    g.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off", "emulate"],
                   help="capture the per-step stages as CUDA graphs (auto: on for CUDA devices)")
    g.add_argument("--debug-sync", action="store_true",
                   help="diagnostics (slow): check every step's indices on the host and wait for the GPU after it, "
                        "so a fault names its stage, rows and values")
    g.add_argument("--first-audio-lane", choices=["on", "off"], default="on" if eng.first_audio_lane else "off",
                   help="run newcomers' steps on a high-priority CUDA stream of their own beside the playing "
                        "streams' steps, so first audio never queues behind a running step")
    g.add_argument("--first-lane-max-batch", type=int, default=eng.first_lane_max_batch,
                   help="rows a first-audio lane step holds at most (its graphs are captured up to this bucket)")
    g.add_argument("--first-audio-chain", choices=["on", "off"], default="on" if eng.first_audio_chain else "off",
                   help="start each segment with one step that runs its prefill, frame 0's codes and its first "
                        "1-frame chunk back to back (no host round trip between them), while that step is predicted "
                        "within --max-step-ms")
    g.add_argument("--collect-first-audio-at-once", choices=["on", "off"],
                   default="on" if eng.collect_first_audio_at_once else "off",
                   help="collect a step that makes first audio before launching the next one (the device idles "
                        "for the host's launch)")
    g.add_argument("--safety-lead-s", type=float, default=eng.safety_lead_s)
    g.add_argument("--max-step-ms", type=float, default=eng.max_step_s * 1e3,
                   help="split a batch whose predicted step is longer (bounds a newcomer's wait); 0 = off")
    g.add_argument("--plan-lead-ms", type=float, default=eng.plan_lead_s * 1e3,
                   help="plan the next step this long before the running one is predicted to end (must cover the "
                        "host's plan and launch, else the GPU idles; CUDA only); 0 = plan at once")
    g.add_argument("--pace-buffer-ms", type=float, default=eng.pace_buffer_s * 1e3,
                   help="pacing at light load: a stream whose listener has this much audio buffered waits instead "
                        "of running ahead (WebSocket and streamed HTTP; a whole-file request never waits); 0 = off")
    g.add_argument("--pace-max-contexts", type=int, default=eng.pace_max_contexts,
                   help="pacing holds streams only while at most this many contexts are open; 0 = half the slots")
    g = s.add_argument_group("operations")
    g.add_argument("--drain-timeout-s", type=float, default=25.0,
                   help="on SIGTERM/SIGINT: how long contexts in flight may finish (under k8s' 30 s grace)")
    g.add_argument("--opus-complexity", type=int, default=10)
    g.add_argument("--encode-threads", type=int, default=max(2, min(8, (os.cpu_count() or 2))))
    g.add_argument("--gil-switch-interval-ms", type=float, default=ServerConfig.gil_switch_interval_ms,
                   help="how long a thread may hold the GIL while another waits (0: Python's 5 ms)")
    g.add_argument("--engine-process", choices=["auto", "on", "off"], default="auto",
                   help="run the engine in a process of its own, so the server's event loop and the engine's loop "
                        "thread do not share one GIL; auto: on for a CUDA device (measured better at 10 and 20 RPS, "
                        "docs/benchmarks), off on the CPU (a second process only costs start-up there)")
    g.add_argument("--no-warmup", action="store_true", help="skip the warm-up utterance before /ready")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--enable-test-hooks", action="store_true", help=argparse.SUPPRESS)
    return p


RANDOM_FRAMES_PER_WORD = 5  # about 2.5 words per second, like real speech
# flags that keep their ServerConfig field's name
SAME_NAME = ("model", "host", "port", "max_sessions", "default_voice", "cpu_threads", "drain_timeout_s",
             "rate_limit_rps", "rate_limit_burst", "http_head_timeout_s", "http_body_timeout_s", "http_keepalive_s",
             "max_connections_per_client", "opus_complexity", "encode_threads", "gil_switch_interval_ms",
             "log_level")


def config_from_args(a: argparse.Namespace) -> ServerConfig:
    keys = list(a.api_key)
    for f in a.api_key_file:
        try:
            keys += read_key_file(f)
        except OSError as exc:
            raise ServerConfigError(f"--api-key-file {f}: {exc.strerror}") from None
    keys += keys_from_env()
    device = resolve_device(a.device)
    dtype = resolve_dtype_name(a.dtype, device)
    bench = a.bench_frames_per_word
    if bench is None:
        bench = RANDOM_FRAMES_PER_WORD if is_random(a.model) else 0
    sched = replace(SchedulerConfig(), max_slots=a.max_slots, bench_frames_per_word=bench,
                    admission_load=a.admission_load, admission_first_audio_s=a.admission_first_audio_ms / 1e3,
                    safety_lead_s=a.safety_lead_s, max_step_s=a.max_step_ms / 1e3, plan_lead_s=a.plan_lead_ms / 1e3,
                    first_audio_lane=a.first_audio_lane == "on", first_lane_max_batch=a.first_lane_max_batch,
                    first_audio_chain=a.first_audio_chain == "on",
                    collect_first_audio_at_once=a.collect_first_audio_at_once == "on",
                    pace_buffer_s=a.pace_buffer_ms / 1e3, pace_max_contexts=a.pace_max_contexts)
    engine = EngineConfig(scheduler=sched, max_frames=a.max_frames, max_prompt_tokens=a.max_prompt_tokens,
                          cuda_graphs=a.cuda_graphs, debug_sync=a.debug_sync,
                          prefix_cache_entries=a.prefix_cache_entries, prefix_cache_mib=a.prefix_cache_mib)
    limits = Limits(**{f.name: getattr(a, f.name) for f in fields(Limits)})
    cfg = ServerConfig(**{name: getattr(a, name) for name in SAME_NAME}, device=device, dtype=dtype, limits=limits,
                       engine=engine, api_keys=Secret(dict.fromkeys(keys)),
                       metrics_key=Secret([a.metrics_key] if a.metrics_key else []),
                       allowed_origins=tuple(o.strip() for v in a.allowed_origins for o in v.split(",") if o.strip()),
                       random_seed=a.seed, test_hooks=a.enable_test_hooks, warmup=not a.no_warmup,
                       engine_process=engine_process_wanted(a.engine_process, device))
    cfg.validate()
    check_model_spec(cfg.model)
    return cfg


def engine_process_wanted(choice: str, device: str) -> bool:
    """--engine-process as a yes or no: "auto" is on for CUDA, where the engine's loop thread is the one that keeps
    the GPU fed and loses time to the event loop's GIL; on the CPU the model's own math dominates."""
    if choice == "auto":
        return device.startswith("cuda")
    return choice == "on"


def check_model_spec(spec: str) -> None:
    """Fail fast on a --model that cannot work (the load itself runs later, on a thread)."""
    from pathlib import Path

    if spec == TINY_RANDOM:
        return
    if spec.startswith("random:"):
        if spec.split(":", 1)[1].lower() not in RANDOM_SIZES:
            raise ServerConfigError(f"--model {spec!r}; random sizes: random:1.7b, random:0.6b, random:tiny")
        return
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ServerConfigError(f"--model {spec!r}: not a checkpoint directory (no config.json); give a Qwen3-TTS "
                                "12Hz CustomVoice checkpoint directory, tiny-random, random:1.7b or random:0.6b")


def print_config(cfg: ServerConfig) -> None:
    d = cfg.describe()
    d["engine"]["scheduler"]["chunk_ramp"] = list(cfg.engine.scheduler.chunk_ramp)
    print("voicelane: resolved configuration", file=sys.stderr)
    print(json.dumps(d, indent=2, default=str), file=sys.stderr)
    if is_random(cfg.model):
        print(RANDOM_NOTICE.format(model=cfg.model), file=sys.stderr)
    sys.stderr.flush()


def freeze_startup_objects() -> tuple[int, float]:
    """Move every object alive now (the model's modules, the tokenizer, the server's tables) out of the garbage
    collector's reach. A full collection walks them all otherwise: about 110 ms with the 1.7B engine loaded (on the
    development CPU), with the GIL held, so the engine thread stops and a playing stream can run dry. Returns (objects
    frozen, ms a full collection of them took)."""
    t0 = time.perf_counter()
    gc.collect()
    full_ms = (time.perf_counter() - t0) * 1e3
    gc.freeze()
    return gc.get_freeze_count(), full_ms


def load_engine(cfg: ServerConfig):
    """The engine, loaded, warmed up and started, with its tokenizer (on the loader thread): here, or in a process
    of its own (--engine-process on)."""
    if cfg.engine_process:
        engine = RemoteEngine.spawn(engine_process_main, cfg)
        if engine.tokenizer_dir is None:
            engine.stop()
            raise RuntimeError("the model has no tokenizer directory")
        tokenizer = TextTokenizer.from_dir(engine.tokenizer_dir)
        frozen, full_ms = freeze_startup_objects()  # a full collection here would stall the event loop instead
        log.info("server process: %d start-up objects frozen (%.0f ms a full collection)", frozen, full_ms)
        return engine, tokenizer
    engine = build_engine(cfg)
    return engine, TextTokenizer.from_dir(engine.loaded.tokenizer_dir)


def engine_process_main(cfg: ServerConfig):
    """The engine process's build (RemoteEngine.spawn pickles this function by name): its own logging and GIL
    switch interval, then the engine as this process would build it."""
    setup_logging(cfg.log_level)
    if cfg.gil_switch_interval_ms:
        sys.setswitchinterval(cfg.gil_switch_interval_ms / 1000.0)
    return build_engine(cfg)


def build_engine(cfg: ServerConfig):
    """Load the model, warm up, freeze the start-up objects out of the garbage collector, start the loop."""
    from engine import Engine  # its first use imports torch

    if cfg.device == "cpu":
        set_cpu_threads(cfg.cpu_threads)
    t0 = time.monotonic()
    loaded = load_model(cfg.model, cfg.device, resolve_dtype(cfg.dtype, cfg.device), cfg.random_seed)
    log.info("model %s loaded in %.1f s on %s (%s)", cfg.model, time.monotonic() - t0, loaded.device, loaded.dtype)
    if loaded.random_weights and not is_random(cfg.model):  # else print_config has shown it
        print(RANDOM_NOTICE.format(model=cfg.model), file=sys.stderr)
    engine = Engine(loaded, cfg.engine)
    if cfg.warmup:
        log.info("warm-up: %.2f s", engine.warmup())
    else:
        engine.warmed_up = True
    frozen, full_ms = freeze_startup_objects()
    log.info("%d start-up objects frozen out of the garbage collector (a full collection of them took %.0f ms)",
             frozen, full_ms)
    engine.start()
    return engine


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything starts: when uvicorn found the port taken it exited while the
    model was loading on another thread, and the process died with SIGABRT instead of saying why."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restarts reuse TIME_WAIT
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def serve(cfg: ServerConfig) -> int:
    try:
        sock = listen(cfg.host, cfg.port)
    except OSError as exc:
        print(f"voicelane: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc} (is another server "
              "running there? pick another --port)", file=sys.stderr)
        return 1
    import uvicorn

    from server.app import create_app
    from server.runtime import Runtime

    runtime = Runtime(cfg)
    app = create_app(runtime, functools.partial(load_engine, cfg))
    if cfg.gil_switch_interval_ms:
        sys.setswitchinterval(cfg.gil_switch_interval_ms / 1000.0)
    try:
        import uvloop  # noqa: F401  (uvicorn's "auto" takes it where it is installed)
    except ImportError:
        log.warning("uvloop is not installed: serving on asyncio's own event loop (slower; pip install uvloop)")
    from uvicorn.config import HTTP_PROTOCOLS, WS_PROTOCOLS
    from uvicorn.importer import import_from_string

    from server.connections import ClientConnections, guarded_protocol

    ws = "websockets-sansio" if "websockets-sansio" in WS_PROTOCOLS else "websockets"
    # "auto": uvloop and httptools where they are installed, else asyncio and h11
    http_protocol = guarded_protocol(import_from_string(HTTP_PROTOCOLS["auto"]),
                                     ClientConnections(cfg.max_connections_per_client), cfg.http_head_timeout_s,
                                     cfg.http_keepalive_s)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, loop="auto", http=http_protocol, ws=ws,
                            ws_max_size=cfg.limits.max_message_bytes, ws_per_message_deflate=False,
                            log_config=None, access_log=False, timeout_graceful_shutdown=5,
                            timeout_keep_alive=cfg.http_keepalive_s,
                            lifespan="on")
    server = _server_class()(config, runtime)  # a class made lazily: uvicorn is imported only to serve
    runtime.on_load_failure = lambda: setattr(server, "should_exit", True)
    # uvicorn puts back the handlers it found once it stops; the default SIGINT one would turn a Ctrl-C during the
    # rest of the shutdown into a KeyboardInterrupt traceback. Ours only notes it (a third one exits at once).
    late: list[int] = []

    def late_signal(sig, frame):
        late.append(sig)
        if len(late) > 1:
            os._exit(128 + sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, late_signal)
    server.run(sockets=[sock])
    code = 0
    if runtime.load_error:
        print(f"voicelane: the model could not be loaded: {runtime.load_error}", file=sys.stderr)
        code = 1
    elif server.stopped_by is not None:
        log.info("stopped by %s without draining", signal.Signals(server.stopped_by).name)
        code = 128 + server.stopped_by  # what a shell reports for a process a signal ended
    if runtime.loading:
        # stopped while the model loads: the interpreter's exit would tear torch down under the loader thread
        # ("terminate called without an active exception", SIGABRT), so leave without it
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _server_class():
    import uvicorn

    class Draining(uvicorn.Server):
        """uvicorn.Server whose first SIGTERM/SIGINT drains (docs/protocol.md 1.5: session.draining, then 1001)."""

        def __init__(self, config, runtime):
            super().__init__(config)
            self.runtime = runtime
            self._drain_task = None
            self.stopped_by: int | None = None  # the signal that stopped the server without a drain

        def handle_exit(self, sig, frame):
            loop = self.runtime.loop or _running_loop()
            if self.runtime.draining or loop is None or self.runtime.engine is None:
                super().handle_exit(sig, frame)
                # uvicorn raises the signals it caught again once it has stopped, and a SIGINT raised then is a
                # KeyboardInterrupt traceback at exit (a double Ctrl-C printed two). The stop was what the signal
                # asked for: serve() reports it in the exit status instead.
                self._captured_signals.clear()
                self.stopped_by = sig
                return
            log.info("signal %s: draining (again to stop at once)", signal.Signals(sig).name)
            loop.call_soon_threadsafe(self._start_drain)

        async def shutdown(self, sockets=None):
            await super().shutdown(sockets=sockets)
            if self.force_exit:
                # uvicorn skips the lifespan's shutdown on a forced exit; the lifespan task is then cancelled at
                # the loop's end and logged as an ERROR traceback. Run it (it only stops the engine), bounded.
                with contextlib.suppress(Exception, asyncio.TimeoutError):
                    await asyncio.wait_for(self.lifespan.shutdown(), 2.0)

        def _start_drain(self):
            self.runtime.start_drain()
            self._drain_task = asyncio.ensure_future(self._drain())

        async def _drain(self):
            rt = self.runtime
            deadline = (rt.drain_deadline or time.monotonic()) + 2.0
            while not rt.drained() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            log.info("drained: stopping")
            self.should_exit = True

    return Draining


def _running_loop():
    try:
        return asyncio.get_event_loop()
    except RuntimeError:
        return None


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the server took over its signals (flags, imports): no traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # nor from a second one while the interpreter exits
        print("voicelane: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        cfg = config_from_args(args)
    except (ServerConfigError, ValueError) as exc:
        print(f"voicelane: configuration error: {exc}", file=sys.stderr)
        return 2
    print_config(cfg)
    return serve(cfg)
