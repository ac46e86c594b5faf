"""The engine in a process of its own (`--engine-process on`): the server's event loop and the engine's loop thread
stop sharing one GIL (issue 13 item 4). No torch here: with an explicit --device the server's process never
imports it.

    server process (RemoteEngine)                      engine process (serve_engine_process)
    open_context, readiness, stats, trace -- call -->  command thread: Engine.admit / readiness / stats
                                          <-- reply --
    EngineContext.append_text, flush ...  -- op ---->  command thread: Engine.submit (one way, in order)
    the event loop's reader (add_reader)  <-- events -- the engine thread itself (Engine.hand_over)

Three pipes: commands (server to engine), replies and events (engine to server). The engine thread writes its
events straight into the pipe, so a chunk reaches the server's event loop without waiting for another thread of
the engine process to get that process's GIL. A pipe, not a shared-memory ring: a frame of audio is 7.7 KB, and 128
streams at 12.5 frames a second are about 12 MB/s, which one pickle and one write per delivery move at a small share
of a core; the pipe also orders audio with the other events and tells each side when the other has gone.

Segment numbers come back without a round trip (EngineContext numbers them as the scheduler does), and so do
context ids: the server names each context with a ticket of its own, which the engine process maps to its engine
context id. Admission is a call (`open_context`: the answer is yes or a typed error) or, for a caller that can take
a refusal as the context's first event, one way (`open_context_pipelined`: a refusal comes back as
ContextDone("refused"); the HTTP door, whose status waits for the first audio anyway). Inside `coalesced()` the
commands leave as one write, so a request's open, text and close wake the engine process once and its first text
arrives there with its open, not a write later. The introspection calls wait for a reply. If the engine process
dies, every open context ends with an `internal` error and `running()` turns False (/health answers 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from engine.api import ContextClosed, ContextSpec, EngineError, InvalidRequest, ModelInfo, Overloaded
from engine.config import EngineConfig
from engine.context import EngineContext
from engine.model.sampling_params import SamplingParams
from engine.types import ContextDone, EngineEvent, EngineStats, FastPath, Readiness

if TYPE_CHECKING:
    from engine.engine import Engine

log = logging.getLogger("voicelane.engine")
PIPE_BYTES = 1 << 20  # the events pipe's buffer: a burst of audio never blocks the engine thread on the server
START_TIMEOUT_S = 1800.0  # loading, capturing graphs and warming up; a first Triton compile is most of it
CALL_TIMEOUT_S = 30.0
READ_BYTES = 1 << 20
READS_PER_WAKE = 16


class EngineProcessError(EngineError):
    """The engine process is gone (or never answered): the server's contexts cannot be served."""


@dataclass(frozen=True)
class Hello:
    """What the engine process tells the server once it is warmed up and running."""

    pid: int
    info: ModelInfo
    sampling_defaults: SamplingParams
    config: EngineConfig  # as resolved there (slots sized from the device's memory)
    tokenizer_dir: str | None
    readiness: Readiness


def _frame(message: tuple) -> bytes:
    """The events pipe's framing: 8 bytes of length, then the pickle. Our own, not Connection.send's: the server
    reads the pipe without blocking (the event loop's reader), so it must take frames in pieces."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(8, "little") + data


def _frames(inbox: bytearray) -> list[tuple]:
    """The whole frames at the head of `inbox`, removed from it; a partial frame stays for the next read."""
    out, start = [], 0
    while len(inbox) - start >= 8:
        size = int.from_bytes(inbox[start:start + 8], "little")
        if len(inbox) - start - 8 < size:
            break
        out.append(pickle.loads(inbox[start + 8:start + 8 + size]))
        start += 8 + size
    del inbox[:start]
    return out


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _error_reply(exc: Exception) -> tuple[str, str, str, str | None]:
    return type(exc).__name__, getattr(exc, "code", "internal"), str(exc), getattr(exc, "param", None)


def _rebuild_error(kind: str, code: str, message: str, param: str | None) -> EngineError:
    """The engine process's typed error, the same type here (exceptions with their own __init__ do not pickle)."""
    if kind == "Overloaded":
        return Overloaded(message)
    if kind == "ContextClosed":
        return ContextClosed(message)
    if kind == "InvalidRequest":
        return InvalidRequest(code, message, param)
    error = EngineError(message if kind == "EngineError" else f"{kind}: {message}", param)
    error.code = code
    return error


def _await_start(conn: Connection, process: multiprocessing.process.BaseProcess, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.05):
        if not process.is_alive() and not conn.poll():
            raise EngineProcessError(f"the engine process exited (exit code {process.exitcode}) during {what}")
        if time.monotonic() > deadline:
            raise EngineProcessError(f"the engine process did not answer {what} within {timeout_s:g} s")
    return conn.recv()


def _widen(conn: Connection) -> None:
    try:
        import fcntl

        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (ImportError, AttributeError, OSError) as exc:
        log.info("engine process: the events pipe keeps its default buffer (%s)", exc)


class RemoteEngine:
    """The server's side: the surface of engine.Engine that the server uses, over the pipes."""

    def __init__(self, process: multiprocessing.process.BaseProcess, commands: Connection, events: Connection,
                 replies: Connection, hello: Hello):
        self.process, self.pid = process, hello.pid
        self.info, self.sampling_defaults, self.config = hello.info, hello.sampling_defaults, hello.config
        self.tokenizer_dir = hello.tokenizer_dir
        self.warmed_up = hello.readiness.warmed_up
        self.contexts: dict[int, EngineContext] = {}  # by ticket
        self._tickets = itertools.count(1)
        self._commands, self._events, self._replies = commands, events, replies
        self._call_lock = threading.Lock()  # one call in flight: replies come back in order
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox = bytearray()  # bytes of the events pipe not yet parsed into whole frames
        self._lost: str | None = None  # why the engine can no longer serve
        self._readiness = hello.readiness  # the last answer, kept for when the process is gone
        self._stats: EngineStats | None = None
        self._held: list[tuple] | None = None  # commands inside coalesced(), written when it ends

    @classmethod
    def spawn(cls, build: Callable[..., Engine], *args: Any, start_timeout_s: float = START_TIMEOUT_S) -> RemoteEngine:
        """Start the engine process: `build(*args)` (a module-level function) loads, warms up and starts an Engine
        there. Returns once it is serving; EngineProcessError if it failed to start."""
        mp = multiprocessing.get_context("spawn")  # a forked child would inherit the server's threads and locks
        command_reader, command_writer = mp.Pipe(duplex=False)
        event_reader, event_writer = mp.Pipe(duplex=False)
        reply_reader, reply_writer = mp.Pipe(duplex=False)
        _widen(event_reader)
        process = mp.Process(target=serve_engine_process, name="voicelane-engine",
                             args=(build, args, command_reader, event_writer, reply_writer))
        process.start()
        for end in (command_reader, event_writer, reply_writer):
            end.close()
        try:
            status, detail = _await_start(reply_reader, process, start_timeout_s, "start-up")
        except EngineProcessError:
            process.kill()
            raise
        if status != "ready":
            process.join(10)
            raise EngineProcessError(f"the engine process failed to start: {detail}")
        log.info("engine process %d serving (%s)", detail.pid, detail.info.name)
        return cls(process, command_writer, event_reader, reply_reader, detail)

    # ------------------------------------------------------------------ lifecycle
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the engine's events on `loop` (call on it). The server has one loop for its life; a caller that
        runs one loop after another (tests, tools) moves the reader to the newest."""
        if self._loop is loop or self._events.closed:
            return
        self._detach()
        self._loop = loop
        os.set_blocking(self._events.fileno(), False)  # as uvloop sets it anyway: frames arrive in pieces
        loop.add_reader(self._events.fileno(), self._read_events)

    def running(self) -> bool:
        return self._lost is None and self.process.is_alive()

    def _detach(self) -> None:
        if self._loop is not None and not self._loop.is_closed() and not self._events.closed:
            self._loop.remove_reader(self._events.fileno())

    def _close_events(self) -> None:
        """Stop reading for good. Closing our end also unblocks an engine thread stuck writing into a full pipe
        (its write fails), so the engine process can stop."""
        self._detach()
        self._events.close()

    def stop(self) -> None:
        self._close_events()
        if self.process.is_alive():
            try:
                self._commands.send(("stop",))
            except OSError:
                pass
            self.process.join(10)
            if self.process.is_alive():
                log.warning("engine process %d did not stop within 10 s: killing it", self.pid)
                self.process.kill()
                self.process.join(5)

    # ------------------------------------------------------------------ contexts
    def open_context(self, spec: ContextSpec) -> EngineContext:
        """Admission as a call: the context, or the engine's typed error (Overloaded, InvalidRequest)."""
        loop = asyncio.get_running_loop()
        self.attach(loop)
        ticket = next(self._tickets)
        self._call("open_context", ticket, spec)
        return self._register(ticket, spec, loop)

    def open_context_pipelined(self, spec: ContextSpec) -> EngineContext:
        """Admission one way: the context at once; a refusal is its first and last event, ContextDone("refused")
        with the error's code, message and field. What is sent to it meanwhile is dropped there."""
        if self._lost is not None:
            raise EngineProcessError(f"the engine has stopped ({self._lost}); restart the server")
        loop = asyncio.get_running_loop()
        self.attach(loop)
        ticket = next(self._tickets)
        ctx = self._register(ticket, spec, loop)
        self._send(("open", ticket, spec))
        return ctx

    def _register(self, ticket: int, spec: ContextSpec, loop: asyncio.AbstractEventLoop) -> EngineContext:
        ctx = EngineContext(self, ticket, spec, loop)
        self.contexts[ticket] = ctx  # on the loop that reads the events: none of it can be routed earlier
        return ctx

    def submit(self, op: str, cid: int, *args) -> None:
        self._send(("op", op, cid, args))

    def inject_fault(self, cid: int, kind: str, at_frame: int) -> None:
        self._send(("fault", cid, kind, at_frame))

    def end_pacing(self) -> None:
        self._send(("end_pacing",))

    @contextlib.contextmanager
    def coalesced(self):
        """The one-way commands sent inside (opens, text, closes) leave together when it ends: one write, one wake-up
        of the engine process. On the event loop's thread, as every command is."""
        if self._held is not None:  # nested: the outer one writes
            yield
            return
        self._held = []
        try:
            yield
        finally:
            self._flush_held()

    def _flush_held(self) -> None:
        held, self._held = self._held, None
        if held:
            self._send(held[0] if len(held) == 1 else ("batch", held))

    def _send(self, message: tuple) -> None:
        """One way. A dead engine process raises nothing here: its contexts end with an error from the reader."""
        if self._lost is not None:
            return
        if self._held is not None:
            self._held.append(message)
            return
        try:
            self._commands.send(message)
        except OSError:
            pass

    def _read_events(self) -> None:
        """On the event loop, whenever the events pipe is readable: what has arrived, then each whole frame."""
        eof = False
        try:
            for _ in range(READS_PER_WAKE):  # then back to the loop; it calls again while there is more
                chunk = os.read(self._events.fileno(), READ_BYTES)
                if not chunk:
                    eof = True
                    break
                self._inbox += chunk
        except BlockingIOError:
            pass
        except OSError:
            eof = True
        for message in _frames(self._inbox):
            if message[0] == "events":
                self._route(message[2], message[1])
            elif message[0] == "crashed":
                self._lose(f"the engine loop stopped: {message[1]}")
        if eof:
            self.process.join(0.2)  # it has closed its end: it is exiting (the join is for its exit code)
            self._lose(f"the engine process exited (exit code {self.process.exitcode})")

    def _route(self, batches: list[tuple[int, list[EngineEvent]]], handed: float) -> None:
        for cid, batch in batches:
            ctx = self.contexts.get(cid)
            if ctx is None:
                continue
            if isinstance(batch[-1], ContextDone):
                ctx.ended = True
                del self.contexts[cid]
            ctx._push(batch, handed)

    def _lose(self, reason: str) -> None:
        """The engine can no longer serve: end every open context, as an in-process engine whose loop died does."""
        if self._lost is None:
            self._lost = reason
            log.error("engine process %d: %s; ending %d open context(s)", self.pid, reason, len(self.contexts))
            self._close_events()
        now = time.monotonic()
        for cid, ctx in list(self.contexts.items()):
            ctx.ended = True
            del self.contexts[cid]
            ctx._push([ContextDone("error", 0, "internal", f"engine stopped: {reason}", cid=cid)], now)

    # ------------------------------------------------------------------ calls
    def _call(self, name: str, *args):
        if self._lost is not None:
            raise EngineProcessError(f"the engine has stopped ({self._lost}); restart the server")
        if self._held is not None:  # a call inside coalesced(): what was sent before it goes first
            self._flush_held()
            self._held = []
        with self._call_lock:
            try:
                self._commands.send(("call", name, args))
                ok, value = self._await_reply(name)
            except (OSError, EOFError) as exc:
                raise EngineProcessError(f"the engine process is gone ({type(exc).__name__})") from None
        if ok:
            return value
        raise _rebuild_error(*value)

    def _await_reply(self, name: str):
        """The reply, reading events meanwhile: the engine thread may be blocked writing into a full events pipe
        while the command thread waits to deliver behind it, and only this loop can drain the pipe. (Every call
        comes from the event loop's thread: the server's handlers are coroutines.)"""
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            ready = wait([self._replies] if self._events.closed else [self._replies, self._events], timeout=0.05)
            if self._replies in ready:
                return self._replies.recv()
            if self._events in ready and self._loop is not None and not self._events.closed:
                self._read_events()
            if self._lost is not None:
                raise EngineProcessError(f"the engine has stopped ({self._lost}) during {name}")
            if not ready and not self.process.is_alive():
                raise EngineProcessError(f"the engine process exited (exit code {self.process.exitcode}) during "
                                         f"{name}")
            if time.monotonic() > deadline:
                # a late reply would be read as the next call's: the engine is wedged, so stop serving through it
                self._lose(f"no answer to {name} within {CALL_TIMEOUT_S:g} s")
                raise EngineProcessError(f"the engine process did not answer {name} within {CALL_TIMEOUT_S:g} s")

    def readiness(self) -> Readiness:
        if self.running():
            try:
                self._readiness = self._call("readiness")
            except EngineProcessError:
                pass
        here = FastPath(True, mode=f"process {self.pid}") if self.running() else FastPath(False, self._lost or (
            f"the engine process exited (exit code {self.process.exitcode})"))
        return replace(self._readiness, engine_running=self._readiness.engine_running and self.running(),
                       engine_process=here)

    def stats(self) -> EngineStats:
        """The engine's counters; once its process is gone, the last ones it gave."""
        try:
            self._stats = self._call("stats")
        except EngineProcessError:
            if self._stats is None:
                raise
        return self._stats

    def chrome_trace(self) -> str:
        return self._call("chrome_trace")


# ---------------------------------------------------------------------- the engine process
def serve_engine_process(build: Callable[..., Engine], args: tuple, commands: Connection, events: Connection,
                         replies: Connection) -> None:
    """The engine process's main: build the engine, say hello, then serve commands until told to stop or until the
    server has gone (its end of the commands pipe closes)."""
    # Ctrl-C, and a SIGTERM sent to the whole process group (systemd's default, `timeout`, a shell's job control),
    # reach this process too: the server decides (it drains, then stops us). Without the server, the commands pipe
    # closes and this process stops by itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = build(*args)
    except BaseException as exc:  # noqa: BLE001 - told to the server, which reports it
        log.exception("engine process: start-up failed")
        replies.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    _EngineServer(engine, commands, events, replies).run()


class _EngineServer:
    def __init__(self, engine: Engine, commands: Connection, events: Connection, replies: Connection):
        self.engine, self.commands, self.events, self.replies = engine, commands, events, replies
        self._send_lock = threading.Lock()  # the engine thread and the command thread both deliver
        # the server's tickets and the engine's context ids, while a context is open (set before any of its events
        # can exist, dropped with its ContextDone)
        self._cid_of: dict[int, int] = {}
        self._ticket_of: dict[int, int] = {}
        engine.hand_over = self._send_events
        on_crash = engine.core.on_crash

        def crashed(exc: BaseException) -> None:
            on_crash(exc)  # every open context ends with an error, through hand_over
            self._send(("crashed", f"{type(exc).__name__}: {exc}"))

        engine.core.on_crash = crashed

    def _send_events(self, routed: list[tuple[EngineContext, list[EngineEvent]]], handed: float) -> None:
        batches = []
        for ctx, batch in routed:
            ticket = self._ticket_of.get(ctx.cid)
            if ticket is None:
                continue
            if isinstance(batch[-1], ContextDone):
                self._ticket_of.pop(ctx.cid, None)
                self._cid_of.pop(ticket, None)
            batches.append((ticket, batch))
        if batches:
            self._send(("events", handed, batches))

    def _admit(self, ticket: int, spec: ContextSpec) -> EngineContext:
        engine = self.engine

        def make(cid: int) -> EngineContext:
            self._cid_of[ticket], self._ticket_of[cid] = cid, ticket
            return EngineContext(engine, cid, spec, None)

        return engine.admit(spec, make)

    def _open(self, ticket: int, spec: ContextSpec) -> None:
        """A one-way open: admitted, or refused with the error as the context's only event."""
        try:
            self._admit(ticket, spec)
        except Exception as exc:  # noqa: BLE001 - typed for the server, as a call's error is
            _, code, message, param = _error_reply(exc)
            refused = ContextDone("refused", 0, code, message, error_param=param)
            self._send(("events", time.monotonic(), [(ticket, [refused])]))

    def _send(self, message: tuple) -> None:
        frame = _frame(message)
        with self._send_lock:
            try:
                _write_all(self.events.fileno(), frame)
            except OSError:
                pass  # the server has gone: the command loop sees the pipe close and stops the engine

    def run(self) -> None:
        engine = self.engine
        tokenizer_dir = engine.loaded.tokenizer_dir
        self.replies.send(("ready", Hello(pid=multiprocessing.current_process().pid, info=engine.info,
                                          sampling_defaults=engine.sampling_defaults, config=engine.config,
                                          tokenizer_dir=None if tokenizer_dir is None else str(tokenizer_dir),
                                          readiness=engine.readiness())))
        while True:
            try:
                message = self.commands.recv()
            except (EOFError, OSError):
                log.info("engine process: the server has gone; stopping")
                break
            if message[0] == "stop":
                break
            for command in message[1] if message[0] == "batch" else (message,):
                self._handle(command)
        engine.stop()

    def _handle(self, message: tuple) -> None:
        engine, kind = self.engine, message[0]
        try:
            if kind == "op":
                cid = self._cid_of.get(message[2])
                if cid is not None:  # else refused, or already ended: nothing to do
                    engine.submit(message[1], cid, *message[3])
            elif kind == "open":
                self._open(message[1], message[2])
            elif kind == "fault":
                cid = self._cid_of.get(message[1])
                if cid is not None:
                    engine.inject_fault(cid, *message[2:])
            elif kind == "end_pacing":
                engine.end_pacing()
            elif kind == "call":
                self.replies.send(self._answer(message[1], message[2]))
        except Exception:  # noqa: BLE001 - one bad command never stops the others
            log.exception("engine process: command %s failed", kind)

    def _answer(self, name: str, args: tuple) -> tuple[bool, Any]:
        engine = self.engine
        try:
            if name == "open_context":
                return True, self._admit(*args).cid
            if name == "readiness":
                return True, engine.readiness()
            if name == "stats":
                return True, engine.stats()
            if name == "chrome_trace":
                return True, engine.chrome_trace()
            raise EngineError(f"unknown call {name!r}")
        except Exception as exc:  # noqa: BLE001 - typed for the server
            return False, _error_reply(exc)
