"""The reliability suite of issue 10, bounded for CI: a protocol fuzzer (hypothesis) over every client message type
and field, fault injection beside a healthy sibling, and a disconnect storm that must leave nothing behind.

Each test prints one `RELIABILITY` line with what it measured (docs/RELIABILITY.md quotes them). The server is a
private one: the fuzzer sends thousands of messages, which the default 50 messages/s pacing would stretch to
minutes, and the storm counts the process's tasks and file descriptors, which other tests must not disturb."""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from live_server import CONFIGS, Raw, collect, http_get, run, speak_ctx, start_server
from websockets.exceptions import ConnectionClosed

from server.protocol import CLIENT_TYPES, ERRORS

FUZZ_EXAMPLES = int(os.environ.get("VOICELANE_FUZZ_EXAMPLES", "100"))
ANCHOR_WORDS = [f"anchor{i} " for i in range(40)]  # 80 frames at 2 per word: speaks through the whole fuzz run
ANCHOR_SEED = 424242


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    srv = start_server(tiny_checkpoint, [*CONFIGS["default"], "--max-messages-per-s", "100000", "--message-burst",
                                         "100000", "--max-contexts", "16", "--max-frames", "128"])
    yield srv
    srv.stop()


def test_state(server) -> dict:
    status, _, body = http_get(server.http_url + "/debug/test/state")
    assert status == 200, body
    return json.loads(body)


test_state.__test__ = False  # a helper, not a test


def reference_codes(server, words: list[str], seed_: int) -> str:
    async def go():
        raw = await Raw.open(server.ws_url)
        created = await speak_ctx(raw, "ref", words, create={"sampling": {"seed": seed_}})
        got = await collect(raw, "ref", created["stream_id"])
        await raw.close()
        assert got["end"]["reason"] == "completed", got["end"]
        return got["end"]["codes_sha256"]

    return run(go())


# ------------------------------------------------------------------------------------------------ fuzzer

# Strings over the per-message text limit (4096 characters) but not over max_message_bytes (64 KiB): a bigger
# frame closes the socket with 1009 by design (tests/test_server_errors.py), which is not a per-context error.
NASTY_STRINGS = ["\ud800", "a\udfffb", "x" * 5000, "", " ", "\x00", "é" * 200, "\u202e", "🙂" * 50, "null",
                 "anchor", "f0", "f1"]
NASTY_NUMBERS = [math.nan, math.inf, -math.inf, 1e308, -1e308, 10**30, -(10**30), 2**63, -1, 0, 0.5, 1, 2048, 10**6]
scalars = st.one_of(st.sampled_from(NASTY_STRINGS), st.sampled_from(NASTY_NUMBERS), st.booleans(), st.none(),
                    st.text(max_size=20), st.integers(), st.floats(allow_nan=True, allow_infinity=True))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8) | st.sampled_from(
                                                           NASTY_STRINGS[:3]), inner, max_size=4)), max_leaves=8)
FIELDS = ["context_id", "event_id", "text", "flush", "flush_id", "voice", "language", "instructions", "output_format",
          "audio_transport", "text_layout", "text_normalization", "sampling", "seed", "max_frames", "min_frames",
          "played_ms", "played", "state", "buffered_ms", "id", "defaults", "temperature", "top_k", "top_p"]
GOOD = {"context_id": st.sampled_from(["f0", "f1", "f2", "\ud800", "x" * 200]),
        "text": st.sampled_from(["hello ", "\ud800", "x" * 5000, "word "]),
        "voice": st.sampled_from(["ryan", "nobody", "\udfff", 7]),
        "output_format": st.sampled_from([{"encoding": "pcm_s16le", "sample_rate": 24000}, {"encoding": "opus"},
                                          {"encoding": "mp3"}, "pcm"]),
        "played": st.dictionaries(st.sampled_from(["f0", "\ud800", "x" * 200]), st.sampled_from(NASTY_NUMBERS),
                                  max_size=3),
        "state": st.sampled_from(["playing", "underrun", "bogus", None]),
        "defaults": st.dictionaries(st.sampled_from(["voice", "language", "sampling", "output_format", "bad"]),
                                    values, max_size=3)}


@st.composite
def messages(draw, types: tuple[str, ...]):
    t = draw(st.sampled_from([*types, "nonsense", "\ud800", 5, None]))
    msg: dict = {"type": t}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=5, unique=True)):
        msg[name] = draw(GOOD[name] if name in GOOD and draw(st.booleans()) else values)
    if draw(st.integers(0, 9)) == 0:  # sometimes not an object at all, or not JSON
        return draw(st.sampled_from(["[1,2]", "not json", "{\"type\": \"ping\", \"id\": NaN}", "[" * 300, "1e999"]))
    return msg


def encode(msg) -> str:
    if isinstance(msg, str):
        return msg
    return json.dumps(msg, allow_nan=True)  # NaN / Infinity go out as the JS spellings the server must refuse


class Session:
    """A socket on a background event loop, read by one task, so hypothesis examples (sync) share it."""

    def __init__(self, url: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.inbox: list = []
        self.closed: tuple | None = None
        self.raw: Raw = self.call(Raw.open(url))
        self.reader = None
        self.sync_n = 0

    def start_reader(self) -> None:
        self.reader = asyncio.run_coroutine_threadsafe(self._read(), self.loop)

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _read(self):
        try:
            while True:
                self.inbox.append(await self.raw.recv(3600))
        except ConnectionClosed as exc:
            self.closed = (exc.rcvd.code if exc.rcvd else None, exc.rcvd.reason if exc.rcvd else "")

    def send_and_sync(self, payloads: list[str], timeout: float = 30) -> list:
        """Send, then a ping, and return everything that arrived up to its pong."""
        self.sync_n += 1
        tag = f"sync-{self.sync_n}"
        start = len(self.inbox)

        async def go():
            for p in payloads:
                await self.raw.ws.send(p)
            await self.raw.send({"type": "ping", "id": tag})
            deadline = time.monotonic() + timeout
            while not any(m.get("type") == "pong" and m.get("id") == tag for m in self.inbox[start:]):
                if self.closed is not None:
                    raise AssertionError(f"the socket closed: {self.closed}")
                if time.monotonic() > deadline:
                    raise AssertionError("no pong: the session stopped answering")
                await asyncio.sleep(0.005)
            return self.inbox[start:]

        return self.call(go(), timeout + 5)

    def close(self):
        try:
            self.call(self.raw.close(), 10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


def check_errors(got: list, stats: dict) -> None:
    for m in got:
        if m.get("type") in ("error", "warning"):
            stats["errors"] += 1
            stats["codes"][m["code"]] = stats["codes"].get(m["code"], 0) + 1
            assert m["code"] in ERRORS, m  # typed: one of docs/protocol.md's codes
            if m["type"] == "error":
                assert m["fatal"] is False and isinstance(m["retryable"], bool), m
                assert isinstance(m["message"], str) and m["message"], m


def test_protocol_fuzz_keeps_the_socket_and_a_sibling_exact(server):
    """Every client type and field, fuzzed (the issue's lone surrogates, 70k-character strings, NaN, huge numbers
    and wrong types among the seeds): the socket survives every message, every error is typed and non-fatal, and
    a sibling context on the same socket speaks its utterance exactly as it does alone. cancel_all would (rightly)
    cancel the sibling, so it is fuzzed on a second socket; session.close would (rightly) end the session."""
    reference = reference_codes(server, ANCHOR_WORDS, ANCHOR_SEED)
    main_types = tuple(t for t in CLIENT_TYPES if t not in ("cancel_all", "session.close"))
    stats = {"messages": 0, "errors": 0, "codes": {}, "examples": 0}
    a, b = Session(server.ws_url), Session(server.ws_url)
    try:
        created = a.call(speak_ctx(a.raw, "anchor", ANCHOR_WORDS, create={"sampling": {"seed": ANCHOR_SEED}}))
        a.start_reader()
        b.start_reader()
        t0 = time.monotonic()

        @seed(10)  # a fixed start, so CI runs the same examples; VOICELANE_FUZZ_EXAMPLES widens the search
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(batch=st.lists(messages(main_types), min_size=1, max_size=12),
               other=st.lists(messages(("cancel_all", "ping", "context.create", "text")), max_size=3))
        def fuzz(batch, other):
            payloads = [encode(m) for m in batch]
            check_errors([m for m in a.send_and_sync(payloads) if m.get("context_id") != "anchor"], stats)
            check_errors(b.send_and_sync([encode(m) for m in other]), stats)
            stats["messages"] += len(batch) + len(other)
            stats["examples"] += 1

        fuzz()
        fuzz_s = time.monotonic() - t0
        ends = [m for m in a.inbox if m.get("context_id") == "anchor" and m.get("type") in
                ("context.done", "context.cancelled", "error")]
        deadline = time.monotonic() + 60
        while not ends and time.monotonic() < deadline:
            time.sleep(0.05)
            ends = [m for m in a.inbox if m.get("context_id") == "anchor" and m.get("type") in
                    ("context.done", "context.cancelled", "error")]
        assert ends and ends[0]["type"] == "context.done" and ends[0]["reason"] == "completed", ends
        assert ends[0]["codes_sha256"] == reference, "the sibling's audio changed under the fuzzer"
        packets = [m for m in a.inbox if m.get("type") == "binary" and m["stream_id"] == created["stream_id"]]
        assert [p["seq"] for p in packets] == list(range(len(packets))) and packets[-1]["flags"] & 2, "gaps"
        assert a.closed is None and b.closed is None
    finally:
        a.close()
        b.close()
    print(f"RELIABILITY fuzz: {stats['examples']} examples, {stats['messages']} messages in {fuzz_s:.1f} s, "
          f"{stats['errors']} typed errors {dict(sorted(stats['codes'].items()))}, 0 sockets lost, sibling exact")


# ------------------------------------------------------------------------------------------------ faults


def test_faults_end_only_their_context(server):
    """An exception, NaN logits, or a server fault in one context's step: that context ends with a typed error and
    reason error; siblings batched with it (same socket and another) complete exactly as alone."""
    words = [f"s{i} " for i in range(12)]
    ref = reference_codes(server, words, 7)
    rounds = 3

    async def go():
        a, b = await Raw.open(server.ws_url), await Raw.open(server.ws_url)
        faults = 0
        for r in range(rounds):
            sibs = [(a, await speak_ctx(a, f"sa{r}", words, create={"sampling": {"seed": 7}}), f"sa{r}"),
                    (b, await speak_ctx(b, f"sb{r}", words, create={"sampling": {"seed": 7}}), f"sb{r}")]
            bad = []
            for kind in ("exception", "nan", "internal"):
                cid = f"bad-{kind}-{r}"
                bad.append((cid, kind, await speak_ctx(a, cid, words, create={"test_fault": {"kind": kind,
                                                                                          "at_frame": 3}})))
                faults += 1
            pending = {cid for cid, _, _ in bad} | {f"sa{r}"}
            seen: dict[str, list] = {c: [] for c in pending}
            while pending:
                m = await a.recv(60)
                cid = m.get("context_id")
                if cid in seen:
                    seen[cid].append(m)
                    if m["type"] in ("context.done", "context.cancelled"):
                        pending.discard(cid)
            for cid, kind, _ in bad:
                errors = [m for m in seen[cid] if m["type"] == "error"]
                assert len(errors) == 1 and errors[0]["code"] == ("internal" if kind == "internal"
                                                                  else "synthesis_failed"), seen[cid]
                assert errors[0]["fatal"] is False and seen[cid][-1]["reason"] == "error", seen[cid]
            assert seen[f"sa{r}"][-1]["reason"] == "completed" and seen[f"sa{r}"][-1]["codes_sha256"] == ref
            got = await collect(b, f"sb{r}", sibs[1][1]["stream_id"])
            assert got["end"]["reason"] == "completed" and got["end"]["codes_sha256"] == ref
        await a.close()
        await b.close()
        return faults

    faults = run(go(), timeout=300)
    state = test_state(server)
    print(f"RELIABILITY faults: {faults} injected ({rounds} rounds of exception, nan, internal), "
          f"{2 * rounds} siblings exact, engine open contexts after: {state['engine']['open_contexts']}")


# ------------------------------------------------------------------------------------------------ storm


def _fds(server) -> int:
    return len(os.listdir(f"/proc/{server.proc.pid}/fd"))


def test_disconnect_storm_leaves_nothing_behind(server):
    """Sockets dropped abruptly mid-utterance, closed mid-utterance, cancelled then dropped, and HTTP streams
    abandoned: the engine's contexts and slots, the server's sessions, tasks and file descriptors return to idle,
    and a well-behaved client's utterance during the storm is exact."""
    words = [f"w{i} " for i in range(10)]
    ref = reference_codes(server, words, 99)
    time.sleep(0.5)
    base = test_state(server)
    base_fds = _fds(server)
    assert base["sessions"] == 0 and base["engine"]["open_contexts"] == 0, base
    # 2 contexts a socket: a wave stays under the engine's 32 requests waiting for first audio (beyond: overloaded)
    waves, per_wave = 6, 10

    async def one(i: int):
        raw = await Raw.open(server.ws_url)
        for c in range(2):  # not speak_ctx: on a loaded machine admission may refuse a create, and that is fine here
            await raw.send({"type": "context.create", "context_id": f"c{c}"})
            for w in words:
                await raw.send({"type": "text", "context_id": f"c{c}", "text": w})
            if c == 0:
                await raw.send({"type": "context.close", "context_id": "c0"})
        # audio flowing, or (a loaded machine) a retryable refusal: either way the drop below is mid-session
        await raw.recv_until(lambda m: m.get("type") == "binary" or (m.get("type") == "error" and m.get("retryable")),
                             timeout=60)
        mode = i % 4
        if mode == 0:
            raw.ws.transport.abort()
        elif mode == 1:
            await raw.close()
        elif mode == 2:
            await raw.send({"type": "context.cancel", "context_id": "c0"})
            raw.ws.transport.abort()
        else:
            await raw.send({"type": "cancel_all"})
            await raw.ws.send("{" * 5)
            raw.ws.transport.abort()

    async def http_drop():
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        body = json.dumps({"input": " ".join(words * 3), "response_format": "pcm"}).encode()
        writer.write(b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        await reader.read(2000)  # the response has begun
        writer.transport.abort()

    async def go():
        good = await Raw.open(server.ws_url)
        created = await speak_ctx(good, "good", words, create={"sampling": {"seed": 99}})
        good_task = asyncio.create_task(collect(good, "good", created["stream_id"], timeout=120))
        dropped = 0
        for w in range(waves):
            await asyncio.gather(*(one(w * per_wave + i) for i in range(per_wave)), http_drop(), http_drop())
            dropped += per_wave + 2
            # the next wave starts once this one's contexts have left the engine (on a slow machine they linger
            # and would count against the 32 waiting for first audio): the storm stays a storm of drops
            for _ in range(300):
                if (await asyncio.to_thread(test_state, server))["engine"]["open_contexts"] <= 1:
                    break
                await asyncio.sleep(0.1)
        got = await good_task
        await good.close()
        return dropped, got

    dropped, got = run(go(), timeout=300)
    assert got["end"]["reason"] == "completed" and got["end"]["codes_sha256"] == ref
    deadline = time.monotonic() + 20
    while True:
        state, fds = test_state(server), _fds(server)
        idle = (state["sessions"] == 0 and state["http_streams"] == 0 and state["engine"]["open_contexts"] == 0
                and state["engine"]["free_slots"] == base["engine"]["free_slots"] and state["tasks"] <= base["tasks"]
                and fds <= base_fds)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert idle, (base, base_fds, state, fds)
    print(f"RELIABILITY storm: {dropped} connections dropped or closed mid-utterance ({waves} waves), sessions "
          f"{state['sessions']}, engine contexts {state['engine']['open_contexts']}, free slots "
          f"{state['engine']['free_slots']}/{base['engine']['free_slots']}, tasks {state['tasks']} "
          f"(before {base['tasks']}), fds {fds} (before {base_fds}); the bystander's utterance exact")
