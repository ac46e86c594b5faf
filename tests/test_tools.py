"""The command-line tools: make_checkpoint and synthesize."""

from __future__ import annotations

import json
import subprocess
import sys
import wave

import numpy as np
import pytest
import torch

from engine.model.codec_layers import layout_choice
from engine.model.generate import Frame, GenerationRequest, generate
from engine.model.prompt import build_prompt, resolve_voice
from engine.model.sampling_params import SamplingParams
from engine.text.tokenizer import TextTokenizer


def test_synthesize_writes_wav_and_codes(tiny_checkpoint, tiny_model, tmp_path):
    out, codes_out = tmp_path / "a.wav", tmp_path / "a.npy"
    text = "Hello there, how are you today?"
    cmd = [sys.executable, "-m", "engine.tools.synthesize", "--model", str(tiny_checkpoint), "--text", text,
           "--voice", "Ryan", "--language", "en", "--greedy", "--max-frames", "12", "--out", str(out),
           "--codes-out", str(codes_out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    codes = np.load(codes_out)
    assert codes.shape == (12, 16) and codes.dtype.kind == "i"
    with wave.open(str(out)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert w.getnframes() == 12 * 1920
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    assert pcm.std() > 100  # audible, not silence
    ids = TextTokenizer.from_dir(tiny_checkpoint).encode(text)
    cfg = tiny_model.config
    req = GenerationRequest(build_prompt(cfg, resolve_voice(cfg, "ryan", "en"), ids, "dual"), ids, "dual",
                            SamplingParams(temperature=0.0, sub_temperature=0.0, max_frames=12))
    ref = torch.stack([e.codes for e in generate(tiny_model.tts, [req]) if isinstance(e, Frame)]).numpy()
    assert np.array_equal(codes, ref)


def test_synthesize_reports_a_bad_voice(tiny_checkpoint, tmp_path):
    cmd = [sys.executable, "-m", "engine.tools.synthesize", "--model", str(tiny_checkpoint), "--text", "Hi.",
           "--voice", "nobody", "--out", str(tmp_path / "x.wav")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unknown voice" in proc.stderr


def test_profile_stages_times_and_counts_every_stage(tmp_path):
    from engine.tools.profile_stages import main

    out = tmp_path / "stages.json"
    main(["--model", "tiny-random", "--device", "cpu", "--batches", "1", "3", "--prompt-lens", "8", "40",
          "--chunks", "1", "5", "--graphs", "off", "emulate", "--repeat", "1", "--out", str(out)])
    record = json.loads(out.read_text())
    rows = record["rows"]
    assert record["kernels"]["compile"]["parts"] == [] and record["kernels"]["cuda_kernels"] in ("triton", "torch")
    seen = {(r["stage"], r["batch"], r.get("prompt_len", r.get("chunk")), r["graphs"]) for r in rows}
    for mode in ("off", "emulate"):
        for b in (1, 3):
            assert {("prefill", b, 8, mode), ("prefill", b, 40, mode), ("talker", b, None, mode),
                    ("code_predictor", b, None, mode), ("codec", b, 1, mode), ("codec", b, 5, mode)} <= seen
    assert all(r["ms"] > 0 and r["kernels"] > 0 for r in rows)
    cached = [r for r in rows if r["stage"] == "prefill" and r.get("cached_prefix")]  # --cached-lens 1 (default)
    assert {(r["batch"], r["graphs"]) for r in cached} == {(b, m) for b in (1, 3) for m in ("off", "emulate")}
    assert all(r["positions"] == r["prompt_len"] == 1 and r["cached_prefix"] == 8 for r in cached)  # auto voice
    whole = [r for r in rows if r["stage"] == "prefill" and not r.get("cached_prefix")]
    assert all(r["positions"] == r["prompt_len"] + 10 for r in whole)
    assert {r["codec_layout"] for r in rows if r["stage"] == "codec"} == {layout_choice()}
    longer = {r["batch"]: r["kernels"] for r in rows if r["stage"] == "prefill" and r["prompt_len"] == 40}
    assert all(k > 50 for k in longer.values())  # a real forward ran (a failed row raises instead)
    for r in rows:  # the per-name breakdown: the costliest first, its counts within the call's total
        top = r["top_kernels"]
        assert top and [k["total_us"] for k in top] == sorted((k["total_us"] for k in top), reverse=True)
        assert sum(k["count"] for k in top) <= r["kernels"] and all(k["name"].startswith("aten::") for k in top)
        assert r["span_us"] is None  # the device window is a CUDA measure


def test_device_span_is_first_start_to_last_end_with_overlaps_and_gaps():
    from engine.tools.profile_stages import span_us

    assert span_us([(10.0, 12.0)]) == 2.0
    assert span_us([(15.0, 20.0), (10.0, 14.0), (13.0, 30.0)]) == 20.0  # out of order, overlapping, a gap


def test_profile_stages_captures_the_graphs_of_the_stages_it_times():
    """A cold GPU compiles every kernel of every graph captured: timing the Code Predictor alone captures its graphs
    only (one per batch bucket); the first-audio chain needs the prefill's, the Code Predictor's and the codec's."""
    from engine.model_source import load_model
    from engine.tools.profile_stages import StageProfiler

    loaded = load_model("tiny-random", "cpu", torch.float32)
    alone = StageProfiler(loaded, "emulate", 3, 8, frozenset({"code_predictor"}))
    assert alone.graphs_captured == len(alone.runner.graphs.buckets) > 0
    every = StageProfiler(loaded, "emulate", 3, 8).graphs_captured
    chain = StageProfiler(loaded, "emulate", 3, 8, frozenset({"prefill", "code_predictor", "codec"})).graphs_captured
    assert alone.graphs_captured < chain < every
    with pytest.raises(ValueError, match="unknown stages"):
        alone.runner.graphs.capture_all({"first_audio"})


def test_profile_stages_captures_only_the_timed_shapes_and_writes_each_row(tmp_path, monkeypatch):
    """--capture timed: a graph per timed (stage, batch) only, made on its warm-up call (a compiled part compiles
    per bucket); the JSON is rewritten after every row, so a run killed at its time limit keeps its rows."""
    from engine.graphs import GraphBank
    from engine.tools import profile_stages

    out = tmp_path / "stages.json"
    seen_by_row: list[int] = []
    entries = []
    real_entry = GraphBank._entry

    def entry(self, batch, key):  # every graph the runner asks for
        entries.append((self.name, batch))
        return real_entry(self, batch, key)

    def measured_so_far(row):
        seen_by_row.append(len(json.loads(out.read_text())["rows"]))

    monkeypatch.setattr(GraphBank, "_entry", entry)
    real_profile = profile_stages.profile
    monkeypatch.setattr(profile_stages, "profile", lambda *args, on_row, **kw: real_profile(
        *args, **kw, on_row=lambda row: (on_row(row), measured_so_far(row))))
    profile_stages.main(["--model", "tiny-random", "--device", "cpu", "--batches", "1", "3", "--prompt-lens", "8",
                         "--stages", "code_predictor", "--graphs", "emulate", "--capture", "timed", "--repeat", "1",
                         "--cached-lens", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["complete"] and [(r["stage"], r["batch"]) for r in record["rows"]] == [
        ("code_predictor", 1), ("code_predictor", 3)]
    assert seen_by_row == [1, 2]
    assert {b for name, b in entries if name == "code_predictor"} == {1, 3}  # buckets 1 and 3 only, not 2


def test_stages_summary_prints_every_row_and_says_what_it_cannot_read(tmp_path, capsys):
    from bench.stages_summary import main

    row = {"stage": "talker", "batch": 64, "graphs": "on", "ms": 2.5, "kernel_us": 1710.0, "kernels": 340}
    (tmp_path / "a.json").write_text(json.dumps({
        "gpu": "H", "torch": "2.11", "complete": False, "capture_failures": {},
        "kernels": {"compile": {"compiles": [{"part": "talker", "shape": [64, 1, 2048], "seconds": 30.0}]}},
        "rows": [row, {**row, "stage": "codec", "batch": 1, "chunk": 12, "ms": 1.19}]}))
    (tmp_path / "cut.json").write_text('{"rows": [')  # a file being rewritten when the run was killed
    main([str(tmp_path / "a.json"), str(tmp_path / "cut.json")])
    lines = capsys.readouterr().out.splitlines()
    assert "complete=False" in lines[0] and "'seconds': 30.0" in lines[1]
    assert lines[2].split() == ["talker", "B64", "on", "2.500", "ms", "1.710", "kernel", "ms", "340", "kernels"]
    assert lines[3].split()[:5] == ["codec", "B1", "12", "on", "1.190"]
    assert lines[4].startswith(f"{tmp_path / 'cut.json'}: unreadable")


def test_profile_stages_measures_the_codec_in_every_layout(tmp_path):
    """--codec-layouts: the codec stage once per activation layout, the other stages once."""
    from engine.tools.profile_stages import main

    out = tmp_path / "stages.json"
    main(["--model", "tiny-random", "--device", "cpu", "--batches", "1", "--prompt-lens", "8", "--chunks", "2",
          "--graphs", "emulate", "--codec-layouts", "contiguous", "channels_last", "--repeat", "1",
          "--cached-lens", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert sorted(r["codec_layout"] for r in rows if r["stage"] == "codec") == ["channels_last", "contiguous"]
    assert sorted(r["stage"] for r in rows if r["stage"] != "codec") == ["code_predictor", "first_audio", "prefill",
                                                                       "talker"]


def test_synthesize_caps_random_weights_by_words(tmp_path):
    """Issue 10, item 8: the README's example (a make_checkpoint folder, no --max-frames) ran for a minute and wrote
    164 s of noise for "Hello there."; random weights are now capped at 5 frames per word, like the server."""
    from engine.model_source import is_random, is_random_checkpoint
    from engine.tools.make_checkpoint import main as make_checkpoint

    ckpt = tmp_path / "tiny"
    assert make_checkpoint(["--size", "tiny", "--out", str(ckpt)]) == 0
    assert is_random_checkpoint(ckpt) and is_random(str(ckpt))  # the server caps it too (benchmark length mode)
    out = tmp_path / "hello.wav"
    cmd = [sys.executable, "-m", "engine.tools.synthesize", "--model", str(ckpt), "--text", "Hello there.",
           "--voice", "ryan", "--language", "english", "--greedy", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "random weights" in proc.stderr and "capped at 10 frames" in proc.stderr, proc.stderr
    with wave.open(str(out)) as w:
        assert w.getnframes() == 10 * 1920  # 2 words x 5 frames x 80 ms


def test_gpu_check_codec_smoke_on_the_cpu(tmp_path):
    """The codec check's CPU smoke run: every layout checked (streaming equals whole, layouts agree) and timed,
    in one call, into one JSON."""
    from engine.model.codec_layers import LAYOUTS
    from engine.tools.gpu_check_codec import main

    assert main([str(tmp_path), "--device", "cpu", "--size", "tiny", "--batches", "1", "--chunks", "2",
                 "--frames", "5", "--repeat", "1"]) == 0
    report = json.loads((tmp_path / "gpu_check_codec.json").read_text())
    assert report["ok"] and list(report["layouts"]) == list(LAYOUTS)
    second = report["layouts"][LAYOUTS[1]]["checks"]
    assert second["streaming"]["fp32_ok"] and second["same_as_first_layout"]["ok"]
    assert [(c["batch"], c["chunk"]) for c in report["compare"]] == [(1, 2)]
    assert all(report["compare"][0][layout] > 0 for layout in LAYOUTS)
