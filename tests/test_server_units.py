"""Server parts without a server: the text pipeline (normalisation + incremental tokenizer), the per-context
audio stages (silence trimming at every segment start, on synthetic silence + tone), protocol parsing, auth."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import opuslib
import pytest

from engine import AudioChunk, ContextDone
from engine.config import SchedulerConfig
from engine.model.sampling_params import SamplingParams
from engine.text.tokenizer import TextTokenizer
from server.audio import AudioStream, OpusOutput, PcmOutput, open_audio_file
from server.auth import KeyChecker, OriginPolicy, query_token, subprotocol_token
from server.config import Secret, ServerConfig
from server.options import (
    Catalog,
    Defaults,
    parse_output_format,
    parse_sampling,
    resolve_context_options,
    validate_sampling,
)
from server.protocol import ProtocolError
from server.stream import ContextStream
from server.text.pipeline import TextPipeline, encode_whole

SR = 24000


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return TextTokenizer.from_dir(tiny_checkpoint)


# ------------------------------------------------------------------------------------------------------ text


def test_llm_normalisation_before_tokenizing(tok):
    cases = [
        ("**Bold** and _italic_ words", "Bold and italic words"),
        ("Run this:\n```python\nprint('hi')\n```\nThen relax.", "Run this:\nThen relax."),
        ("See [the docs](https://example.com/a_b) now", "See the docs now"),
        ("Great job 🎉! Thumbs 👍🏽 up", "Great job! Thumbs up"),
        ("# Heading\n- item one\n- item two", "Heading\nitem one\nitem two"),
    ]
    for markdown, plain in cases:
        assert encode_whole(tok, markdown, "llm") == encode_whole(tok, plain, "none"), markdown
        assert encode_whole(tok, markdown, "none")[0] != encode_whole(tok, plain, "none")[0]


def test_any_split_gives_the_whole_text_ids(tok):
    rng = random.Random(7)
    texts = ["Hello world, this is **bold** and `code` with [a link](http://x.y) 🎉! Don't stop.",
             "你好，世界！这是一个测试。", "Numbers 1234 and 3.14; e.g. co-operate.\n\n- item\n- two",
             "  leading and trailing   ", "Mid-word splits: extraordinary, unbelievable."]
    for text in texts:
        for norm in ("llm", "none"):
            whole = encode_whole(tok, text, norm)
            for _ in range(20):
                cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, min(12, len(text) - 1))))
                p = TextPipeline(tok, norm)
                ids = []
                for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
                    ids += p.feed(text[a:b])
                rest, w = p.finish()
                assert (ids + rest, w) == whole, (text, norm, cuts)


def test_a_word_is_committed_when_its_space_arrives(tok):
    p = TextPipeline(tok, "llm")
    assert p.feed("Hello") == []  # the word may go on
    assert p.feed(" ") == tok.encode("Hello")  # now it cannot
    assert p.feed("wor") == []
    assert p.feed("ld, ") == tok.encode(" world")  # "," waits: punctuation may go on
    assert p.feed("**bold**") == tok.encode(",")
    rest, words = p.finish()
    assert rest == tok.encode(" bold") and words == 3
    # the next segment starts fresh
    assert p.feed("Next ") == tok.encode("Next")


def test_a_flush_inside_a_code_fence_keeps_the_code_silent(tok):
    p = TextPipeline(tok, "llm")
    ids = p.feed("Run this:\n```\nx = 1\n")
    rest, _ = p.finish(closing=False)  # flush mid-block: the fence stays open
    ids += rest
    ids += p.feed("y = 2\n```\nDone. ")
    rest, _ = p.finish()
    spoken = tok.decode(ids + rest)
    assert "Run this" in spoken and "Done." in spoken
    assert "x = 1" not in spoken and "y = 2" not in spoken


def test_segments_count_words(tok):
    p = TextPipeline(tok, "llm")
    p.feed("one two  three\nfour")
    assert p.finish()[1] == 4
    p.feed("   ")
    assert p.finish() == ([], 0)


# ------------------------------------------------------------------------------------------------------ audio


def silence_then_tone(silence_s: float, tone_s: float, amp: float = 0.3) -> np.ndarray:
    sil = np.random.default_rng(0).normal(0, 1e-5, int(silence_s * SR)).astype(np.float32)
    t = np.arange(int(tone_s * SR)) / SR
    return np.concatenate([sil, (amp * np.sin(2 * np.pi * 440 * t)).astype(np.float32)])


def chunks(x: np.ndarray, n: int = 1920):
    return [x[i:i + n] for i in range(0, len(x), n)]


def test_leading_silence_trimmed_at_every_segment_start():
    stream = AudioStream(PcmOutput("pcm_s16le", 24000), segment_flush=True)
    packets = []
    for seg in (silence_then_tone(0.3, 0.5), silence_then_tone(0.2, 0.4)):
        for c in chunks(seg):
            packets += stream.process(c)
        packets += stream.end_segment()
    pcm = np.frombuffer(b"".join(p.payload for p in packets), "<i2").astype(np.float32) / 32767
    # kept: the 20 ms pre-roll before each onset and all of the tone; nothing audible was cut
    assert len(pcm) == pytest.approx(0.5 * SR + 0.4 * SR + 2 * 0.02 * SR, abs=2 * 24)
    assert stream.trimmed_samples == pytest.approx((0.28 + 0.18) * SR, abs=2 * 24)
    first_loud = np.flatnonzero(np.abs(pcm) > 0.01)[0]
    assert first_loud == pytest.approx(0.02 * SR, abs=24)
    # one timeline counted from the first sample kept; each segment's first packet is flagged
    starts = [p.start_sample for p in packets]
    assert starts[0] == 0 and all(b == a + p.samples for a, b, p in zip(starts, starts[1:], packets, strict=False))
    assert [p.segment_start for p in packets].count(True) == 2
    seg2 = next(i for i, p in enumerate(packets) if p.segment_start and i > 0)
    assert packets[seg2].start_sample == pytest.approx(0.52 * SR, abs=24)
    assert stream.audio_end_ms == pytest.approx(len(pcm) / 24, abs=0.01)


def test_tone_from_the_start_is_never_trimmed_and_silence_only_segment_is_dropped():
    stream = AudioStream(PcmOutput("pcm_s16le", 24000), segment_flush=True)
    tone = silence_then_tone(0.0, 0.2)
    kept = b"".join(p.payload for c in chunks(tone) for p in stream.process(c))
    kept += b"".join(p.payload for p in stream.end_segment())
    assert len(kept) // 2 == len(tone) and stream.trimmed_samples == 0
    for c in chunks(np.zeros(SR // 2, np.float32)):
        assert stream.process(c) == []
    assert stream.end_segment() == [] and stream.trimmed_samples == SR // 2


def test_opus_stream_with_trimming_decodes_to_the_kept_audio():
    stream = AudioStream(OpusOutput(), segment_flush=True)
    assert stream.pre_skip == 312 and stream.clock_rate == 48000
    packets = [p for c in chunks(silence_then_tone(0.25, 0.3)) for p in stream.process(c)]
    packets += stream.end_segment() + stream.close()
    dec = opuslib.Decoder(48000, 1)
    pcm = np.concatenate([np.frombuffer(dec.decode(p.payload, 5760), "<i2") for p in packets])[312:]
    kept_ms = 300 + 20
    assert stream.audio_end_ms == pytest.approx(kept_ms, abs=1)
    assert kept_ms * 48 <= len(pcm) <= (kept_ms + 26.5) * 48
    assert all(p.samples == 960 for p in packets) and packets[0].segment_start


def test_http_stream_trims_too():
    file = open_audio_file("pcm")
    s = AudioStream(file.output, segment_flush=False)
    body = b"".join(file.body(s.process(c)) for c in chunks(silence_then_tone(0.5, 0.2)))
    body += file.body(s.end_segment()) + file.end(s.close())
    assert len(body) // 2 == pytest.approx(0.22 * SR, abs=48)


class CountingExecutor(ThreadPoolExecutor):
    def __init__(self):
        super().__init__(max_workers=1)
        self.calls = 0

    def submit(self, fn, /, *args, **kwargs):
        self.calls += 1
        return super().submit(fn, *args, **kwargs)


class OneChunkContext:
    """An engine context that says one audible chunk (after `silence_s` of leading silence), then ends."""

    def __init__(self, silence_s: float = 0.0):
        self.silence_s = silence_s
        self.audible, self.trimmed = [], []

    async def events(self):
        tone = silence_then_tone(self.silence_s, 0.08 - self.silence_s)
        yield AudioChunk(pcm=tone, start_sample=0, segment=0, first_frame=0, codes=np.zeros((1, 16), np.int64), cid=1)
        yield ContextDone("completed", len(tone), cid=1)

    def mark_audible(self, segment, trimmed_s=0.0):
        self.audible.append(segment)
        self.trimmed.append(trimmed_s)


@pytest.mark.parametrize("output,on_pool", [(lambda: PcmOutput("pcm_s16le", 24000), 0),
                                            (lambda: PcmOutput("pcm_s16le", 16000), 1), (OpusOutput, 1)])
def test_native_rate_pcm_is_encoded_on_the_event_loop_and_the_rest_on_the_pool(output, on_pool):
    """A cast needs no thread hop (two GIL hand-offs under load); resampling and Opus keep the loop free."""
    pool = CountingExecutor()
    stream = ContextStream(OneChunkContext(), AudioStream(output(), segment_flush=False), pool)

    async def drain():
        return [ev async for ev in stream.events()]

    events = asyncio.run(drain())
    pool.shutdown()
    assert pool.calls == on_pool and events[-1].done is not None
    assert sum(p.samples for p in events[0].packets) > 0 and stream.ectx.audible == [0]


def test_the_onset_report_says_how_much_leading_silence_was_dropped():
    """The engine's playback clock must not count trimmed silence as audio the listener has: the onset report
    carries the amount the trimmer dropped (50 ms of silence, less its 20 ms pre-roll)."""
    stream = ContextStream(OneChunkContext(silence_s=0.05), AudioStream(PcmOutput("pcm_s16le", 24000),
                                                                       segment_flush=False), None)

    async def drain():
        return [ev async for ev in stream.events()]

    asyncio.run(drain())
    assert stream.ectx.audible == [0] and stream.ectx.trimmed[0] == pytest.approx(0.03, abs=0.003)


def test_startup_objects_are_frozen_out_of_full_collections():
    """What start-up made (here: a marker) leaves the collector's generations, so a full collection no longer walks
    it (on the 1.7B engine a full collection held the GIL for ~110 ms)."""
    import gc

    from server.cli import freeze_startup_objects

    marker = [object() for _ in range(1000)]
    try:
        frozen, full_ms = freeze_startup_objects()
        assert frozen >= len(marker) and full_ms >= 0
        assert not any(o is marker for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(o is marker for o in gc.get_objects())


# ------------------------------------------------------------------------------------------------------ protocol


def test_output_format_shorthands():
    assert parse_output_format("opus_48000_32").to_dict() == {"encoding": "opus", "sample_rate": 48000,
                                                              "channels": 1, "frame_ms": 20, "bitrate": 32000}
    assert parse_output_format("pcm_24000").sample_rate == 24000
    assert parse_output_format("pcm_16000").encoding == "pcm_s16le"
    assert parse_output_format("mulaw_8000").encoding == "pcm_mulaw"
    assert parse_output_format({"encoding": "pcm_f32le", "sample_rate": 8000}).sample_rate == 8000
    for bad in ("mp3_44100", "pcm_44100", {"encoding": "opus", "frame_ms": 10}, {"encoding": "pcm_s16le",
                                                                                   "channels": 2}):
        with pytest.raises(ProtocolError) as e:
            parse_output_format(bad)
        assert e.value.code == "unsupported_format"
    with pytest.raises(ProtocolError) as e:
        parse_output_format(5)
    assert e.value.code == "invalid_field"


def test_sampling_parsing_and_validation():
    base = SamplingParams()
    over = parse_sampling({"temperature": 0, "top_k": 5, "seed": 9, "subtalker": {"top_p": 0.5}})
    p = validate_sampling(base, over)
    assert (p.temperature, p.sub_temperature, p.top_k, p.seed, p.sub_top_p) == (0, 0, 5, 9, 0.5)
    for bad, param in (({"temperature": "hot"}, "sampling.temperature"), ({"top_k": 1.5}, "sampling.top_k"),
                       ({"subtalker": []}, "sampling.subtalker"), ({"seed": True}, "sampling.seed")):
        with pytest.raises(ProtocolError) as e:
            parse_sampling(bad)
        assert e.value.param == param
    with pytest.raises(ProtocolError) as e:
        validate_sampling(base, parse_sampling({"subtalker": {"temperature": 99}}))
    assert e.value.param == "sampling.subtalker.temperature"


def test_context_options_resolution():
    catalog = Catalog(("ryan", "vivian"), ("auto", "english", "chinese"))
    d = Defaults(voice="ryan")
    o = resolve_context_options({"voice": "Vivian", "language": "EN", "max_frames": 10}, d, catalog,
                                SamplingParams(), max_frames_limit=64, max_instruction_chars=100,
                                draw_seed=lambda: 42)
    assert (o.voice, o.language, o.sampling.max_frames, o.sampling.seed, o.seed_given) == (
        "vivian", "english", 10, 42, False)
    with pytest.raises(ProtocolError) as e:
        resolve_context_options({"min_frames": 20, "max_frames": 10}, d, catalog, SamplingParams(),
                                max_frames_limit=64, max_instruction_chars=100, draw_seed=lambda: 1)
    assert e.value.code == "invalid_field"


def test_keys_and_origins():
    k = KeyChecker(["alpha", "beta"])
    assert k.check("alpha") and k.check("beta") and not k.check("alph") and not k.check("") and not k.check(None)
    assert KeyChecker([]).check(None)
    assert query_token(b"a=1&token=xyz") == "xyz" and subprotocol_token(["voicelane.v1", "bearer.k"]) == "k"
    o = OriginPolicy(["https://app.example"])
    assert o.allows(None, "h:1") and o.allows("https://app.example", "h:1") and o.allows("http://h:1", "h:1")
    assert not o.allows("https://evil.example", "h:1") and not o.allows("null", "h:1")
    assert OriginPolicy(["*"]).allows("https://anything", "h")
    cfg = ServerConfig(api_keys=Secret(["s3cret"]))
    assert "s3cret" not in repr(cfg) and "s3cret" not in str(cfg.describe())


# ------------------------------------------------------------------------------------------------------ CLI


def test_cli_resolves_flags_keys_and_hides_them(tmp_path, monkeypatch, capsys):
    from server.cli import build_parser, config_from_args, print_config

    key_file = tmp_path / "keys.txt"
    key_file.write_text("# team keys\nfile-key\n\n")
    monkeypatch.setenv("VOICELANE_API_KEYS", "env-a, env-b")
    args = build_parser().parse_args(["serve", "--model", "random:0.6b", "--device", "cpu", "--api-key", "flag-key",
                                      "--api-key-file", str(key_file), "--allowed-origins", "https://a.example,"
                                      "https://b.example", "--bench-frames-per-word", "5", "--max-frames", "100",
                                      "--metrics-key", "m"])
    cfg = config_from_args(args)
    assert set(cfg.api_keys) == {"flag-key", "file-key", "env-a", "env-b"}
    assert cfg.allowed_origins == ("https://a.example", "https://b.example")
    assert cfg.engine.scheduler.bench_frames_per_word == 5 and cfg.engine.max_frames == 100
    assert cfg.dtype == "float32" and cfg.model == "random:0.6b"
    print_config(cfg)
    err = capsys.readouterr().err
    for secret in ("flag-key", "file-key", "env-a", "env-b", '"m"'):
        assert secret not in err
    assert "4 configured" in err and "RANDOM WEIGHTS" in err and '"bench_frames_per_word": 5' in err
    # Random weights never end an utterance: their default is the benchmark length mode; checkpoints: off.
    def bench_of(*argv):
        return config_from_args(build_parser().parse_args(["serve", "--device", "cpu", *argv])).engine.scheduler
    assert bench_of().bench_frames_per_word == 5
    assert bench_of("--bench-frames-per-word", "0").bench_frames_per_word == 0
    assert bench_of().first_audio_chain and not bench_of("--first-audio-chain", "off").first_audio_chain
    assert bench_of().collect_first_audio_at_once
    assert not bench_of("--collect-first-audio-at-once", "off").collect_first_audio_at_once
    assert bench_of().plan_lead_s == SchedulerConfig().plan_lead_s
    assert bench_of("--plan-lead-ms", "2.5").plan_lead_s == 0.0025 and bench_of("--plan-lead-ms", "0").plan_lead_s == 0
    assert bench_of().pace_buffer_s == SchedulerConfig().pace_buffer_s
    paced = bench_of("--pace-buffer-ms", "1500", "--pace-max-contexts", "12")
    assert paced.pace_buffer_s == 1.5 and paced.pace_max_contexts == 12
    # The engine's own process: auto is on for CUDA only; on and off are taken as they are.
    def engine_process_of(*argv):
        return config_from_args(build_parser().parse_args(["serve", *argv])).engine_process
    assert not engine_process_of("--device", "cpu")
    assert engine_process_of("--device", "cpu", "--engine-process", "on")
    assert engine_process_of("--device", "cuda:1") and engine_process_of("--device", "cuda")
    assert not engine_process_of("--device", "cuda", "--engine-process", "off")
    with pytest.raises(Exception, match="not a checkpoint directory"):
        config_from_args(build_parser().parse_args(["serve", "--model", str(tmp_path)]))


def test_cli_device_and_threads_go_through_the_engine():
    """server/cli.py names no torch: `--device auto` and `--cpu-threads` are the engine's resolve_device and
    set_cpu_threads."""
    import torch

    from engine import resolve_device, set_cpu_threads

    assert resolve_device("cpu") == "cpu" and resolve_device("cuda:1") == "cuda:1"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    before = torch.get_num_threads()
    try:
        set_cpu_threads(0)  # 0: torch's default, untouched
        assert torch.get_num_threads() == before
        set_cpu_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_every_client_message_type_has_a_handler():
    """The session dispatches on `type` through its table: a type the envelope accepts but the table lacks would
    answer `internal` instead of doing its job."""
    from server.protocol import CLIENT_TYPES
    from server.ws.session import HANDLERS

    assert set(HANDLERS) == set(CLIENT_TYPES)
    assert all(callable(h) for h in HANDLERS.values())
