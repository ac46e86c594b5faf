"""Baseline: the official qwen-tts package behind a minimal HTTP endpoint, measured closed-loop.

    # one command: load the model, serve it on a local port, measure N requests one at a time, write the report
    python -m bench.baseline_official run --checkpoint random:1.7b --device cuda --dtype bfloat16 \\
        --frames-per-word 5 --n 20 --seed 0 --out baseline.json

    # or the two halves
    python -m bench.baseline_official serve --checkpoint DIR --device cuda --port 8001 --frames-per-word 5
    python -m bench.baseline_official measure --url http://127.0.0.1:8001 --n 20 --seed 0 --out baseline.json

The package cannot stream: `Qwen3TTSModel.generate_custom_voice` returns the whole waveform, so the endpoint
answers `POST /v1/audio/speech` (same body as voicelane's, raw s16le 24 kHz) with the whole utterance at once and
first audio is after the whole utterance. It is slower than real time, so it is measured closed-loop (the next
request is sent when the previous one has ended): at any open-loop rate its queue would grow without bound.

Lengths match voicelane's benchmark mode: a text of W whitespace-separated words gets exactly
frames = frames_per_word * W frames, by `min_new_tokens = max_new_tokens = frames + 1` (the package's
`generate` hard-codes min_new_tokens = 2, so the wrapper overrides that one keyword on its way to the talker's
HF `generate`; nothing else is changed). The text layout is the package's streaming-text mode
(`non_streaming_mode=False`), which is voicelane's default `dual`; sampling is the checkpoint's defaults.

`--checkpoint random:1.7b` writes a random-weight checkpoint of the full 1.7B geometry (engine.tools.make_checkpoint)
into a temporary directory first; the compute per frame is the same as with real weights.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import sys
import tempfile
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

SAMPLE_RATE = 24000

# The audio-file libraries qwen_tts imports at module level; CustomVoice generation and the 12 Hz decoder never
# call them. Where one is not installed, an empty placeholder module takes its place so the import succeeds.
_OPTIONAL_AUDIO_MODULES = ("sox", "onnxruntime", "torchaudio", "torchaudio.compliance",
                           "torchaudio.compliance.kaldi", "librosa", "librosa.filters", "soundfile")


def _placeholder_call(*_a, **_k):
    raise RuntimeError("qwen_tts called an audio library that is not installed (a placeholder was imported)")


def prepare_qwen_tts_import() -> None:
    """Make `import qwen_tts` work without its audio-file dependencies (no-op for those that are installed)."""
    if "qwen_tts" in sys.modules:
        return

    def missing(name: str) -> bool:
        try:
            __import__(name)
            return False
        except Exception:
            return True

    def placeholder(name: str) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # transformers calls find_spec() on some names
        sys.modules[name] = mod
        return mod

    for name in ("sox", "onnxruntime"):
        if missing(name):
            placeholder(name)
    if missing("torchaudio.compliance.kaldi"):
        top, comp, kaldi = (placeholder(n) for n in _OPTIONAL_AUDIO_MODULES[2:5])
        top.compliance = comp
        comp.kaldi = kaldi
    if missing("librosa"):
        lib, filters = placeholder("librosa"), placeholder("librosa.filters")
        filters.mel = _placeholder_call
        lib.filters, lib.load, lib.resample = filters, _placeholder_call, _placeholder_call
    if missing("soundfile"):
        sf = placeholder("soundfile")
        sf.read = sf.write = _placeholder_call


def resolve_checkpoint(spec: str, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """A checkpoint directory, or `random:<size>` written into a temporary directory."""
    if not spec.startswith("random:"):
        return Path(spec)
    import torch

    from engine.model.random_model import write_checkpoint

    size = spec.split(":", 1)[1]
    out = Path(tempfile.mkdtemp(prefix=f"voicelane-official-{size}-")) / size
    t0 = time.time()
    write_checkpoint(out, size, seed, getattr(torch, dtype))
    print(f"wrote random {size} checkpoint to {out} in {time.time() - t0:.1f}s", file=sys.stderr)
    return out


class OfficialTTS:
    """The official Qwen3TTSModel, generating exactly `frames_per_word * words` frames per request."""

    def __init__(self, checkpoint: Path, device: str = "cpu", dtype: str = "float32", attn: str = "sdpa",
                 frames_per_word: int = 5, seed: int | None = 0):
        prepare_qwen_tts_import()
        import torch
        import transformers
        from qwen_tts import Qwen3TTSModel

        transformers.logging.set_verbosity_error()
        self.torch = torch
        self.device = torch.device(device)
        self.frames_per_word = frames_per_word
        self.seed = seed
        t0 = time.time()
        qm = Qwen3TTSModel.from_pretrained(str(checkpoint), dtype=getattr(torch, dtype), attn_implementation=attn,
                                           local_files_only=True)
        qm.model.to(self.device).eval()
        qm.device = self.device
        tok = qm.model.speech_tokenizer
        tok.model.to(self.device).eval()
        tok.device = self.device
        self.load_s = time.time() - t0
        self.qm = qm
        self._min_new_tokens: int | None = None
        talker_generate = qm.model.talker.generate

        def generate_with_min(*args, **kwargs):
            if self._min_new_tokens is not None:
                kwargs["min_new_tokens"] = self._min_new_tokens
            return talker_generate(*args, **kwargs)

        qm.model.talker.generate = generate_with_min
        self.lock = threading.Lock()

    def frames_for(self, text: str) -> int | None:
        return self.frames_per_word * len(text.split()) if self.frames_per_word > 0 else None

    def synthesize(self, text: str, voice: str = "Ryan", language: str = "English") -> tuple[np.ndarray, dict]:
        """int16 PCM at 24 kHz and timing details."""
        frames = self.frames_for(text)
        kw = {}
        if frames is not None:
            kw["max_new_tokens"] = frames + 1
        with self.lock:
            self._min_new_tokens = frames + 1 if frames is not None else None
            if self.seed is not None:
                self.torch.manual_seed(self.seed)
            if self.device.type == "cuda":
                self.torch.cuda.synchronize()
            t0 = time.perf_counter()
            with self.torch.inference_mode():
                wavs, sr = self.qm.generate_custom_voice(text, speaker=voice, language=language,
                                                         non_streaming_mode=False, **kw)
            if self.device.type == "cuda":
                self.torch.cuda.synchronize()
            gen_s = time.perf_counter() - t0
        wav = np.asarray(wavs[0], dtype=np.float32)
        if sr != SAMPLE_RATE:
            raise RuntimeError(f"the package returned {sr} Hz, expected {SAMPLE_RATE}")
        pcm = (np.clip(wav, -1.0, 1.0) * 32767.0).round().astype("<i2")
        got = len(pcm) // 1920
        return pcm, {"frames_requested": frames, "frames": got, "generate_s": gen_s,
                     "ms_per_frame": gen_s * 1e3 / got if got else None}


def make_handler(tts: OfficialTTS):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_a):  # quiet
            pass

        def _json(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            if self.path in ("/health", "/ready"):
                self._json(200, {"ready": True, "official": True, "device": str(tts.device),
                                 "frames_per_word": tts.frames_per_word, "load_s": tts.load_s})
            else:
                self._json(404, {"error": {"message": "not found", "code": "not_found"}})

        def do_POST(self):  # noqa: N802
            if self.path != "/v1/audio/speech":
                self._json(404, {"error": {"message": "not found", "code": "not_found"}})
                return
            try:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                text = str(body["input"])
                if body.get("response_format", "pcm") != "pcm":
                    raise ValueError("only response_format pcm")
            except Exception as e:
                self._json(400, {"error": {"message": str(e), "code": "invalid_field"}})
                return
            try:
                pcm, info = tts.synthesize(text, body.get("voice", "Ryan"), body.get("language", "English"))
            except Exception as e:
                self._json(500, {"error": {"message": repr(e), "code": "internal"}})
                return
            data = pcm.tobytes()
            self.send_response(200)
            self.send_header("Content-Type", "audio/pcm")
            self.send_header("x-sample-rate", str(SAMPLE_RATE))
            self.send_header("x-frames", str(info["frames"]))
            self.send_header("x-generate-ms", f"{info['generate_s'] * 1e3:.1f}")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def start_server(tts: OfficialTTS, host: str = "127.0.0.1", port: int = 8001) -> ThreadingHTTPServer:
    srv = ThreadingHTTPServer((host, port), make_handler(tts))
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, name="official-http", daemon=True).start()
    return srv


async def measure(url: str, n: int, seed: int = 0, voice: str = "Ryan", language: str = "English",
                  warmup: int = 1, budget_s: float | None = None, request_timeout: float = 600.0) -> dict:
    """Closed loop: the seed's prompt sequence, one request at a time; the same metrics code as the loadgen."""
    from bench import metrics
    from bench.loadgen import PROMPT_INDEX, PointConfig, http_speech, new_http_client, now
    from bench.prompts import prompt_sequence

    cfg = PointConfig(url=url, workload="w1", rps=0.0, warmup=0, window=0, seed=seed, voice=voice,
                      language=language, request_timeout=request_timeout)
    texts = prompt_sequence(seed, n)
    records = []
    t_begin = now()
    async with new_http_client(request_timeout) as client:
        for i in range(warmup):  # not measured: first-call overheads (allocator, kernels)
            await http_speech(client, cfg, "A short warm up.", {"id": f"warmup{i}"})
        t_begin = now()
        for i, text in enumerate(texts):
            if budget_s is not None and records and now() - t_begin > budget_s:
                break
            rec = {"id": i, "phase": "measured", "status": "pending", "words": len(text.split()),
                   "prompt": PROMPT_INDEX.get(text)}
            t_d = await http_speech(client, cfg, text, rec)
            rec["dispatch_s"] = t_d - t_begin
            frames = rec.get("audio_ms", 0.0) / 80.0
            rec["frames"] = round(frames)
            if rec.get("e2e_ms") and frames:
                rec["ms_per_frame"] = rec["e2e_ms"] / frames
                rec["rtf"] = rec["e2e_ms"] / rec["audio_ms"]
            records.append(rec)
            print(f"official {i}: {rec['words']} words, {rec['frames']} frames, first audio "
                  f"{rec.get('first_playable_ms') or 0:.0f} ms, {rec.get('ms_per_frame') or 0:.1f} ms/frame",
                  file=sys.stderr)
    elapsed = now() - t_begin
    summary = metrics.summarize(records, elapsed)
    summary["peak_in_flight"] = 1
    per_frame = [r["ms_per_frame"] for r in records if r.get("ms_per_frame")]
    rtf = [r["rtf"] for r in records if r.get("rtf")]
    summary["ms_per_frame"] = {**metrics.percentiles(per_frame, (50, 95)), "mean": float(np.mean(per_frame))
                               if per_frame else float("nan")}
    summary["rtf"] = {**metrics.percentiles(rtf, (50, 95))}
    return {"config": {"url": url, "n": n, "seed": seed, "voice": voice, "language": language, "warmup": warmup,
                       "mode": "closed-loop, one request at a time"},
            "summary": summary, "requests": records}


def _report(point: dict, server: dict) -> dict:
    from bench.report import environment

    return {"kind": "baseline_official", **environment("bench.baseline_official"), "server": server,
            "points": [point]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def model_args(p):
        p.add_argument("--checkpoint", required=True, help="checkpoint directory, or random:<size> (e.g. random:1.7b)")
        p.add_argument("--device", default="cpu")
        p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bfloat16 on cuda)")
        p.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, flash_attention_2)")
        p.add_argument("--frames-per-word", type=int, default=5)
        p.add_argument("--model-seed", type=int, default=0, help="weights seed for random:<size>")

    def measure_args(p):
        p.add_argument("--n", type=int, default=20, help="requests to measure")
        p.add_argument("--seed", type=int, default=0, help="prompt sequence seed")
        p.add_argument("--warmup", type=int, default=1, help="unmeasured requests first")
        p.add_argument("--budget", type=float, default=None, help="stop sending new requests after this many s")
        p.add_argument("--out", required=True)

    p_serve = sub.add_parser("serve", help="serve the official package over HTTP")
    model_args(p_serve)
    p_serve.add_argument("--host", default="127.0.0.1")
    p_serve.add_argument("--port", type=int, default=8001)
    p_measure = sub.add_parser("measure", help="closed-loop client against a running endpoint")
    p_measure.add_argument("--url", default="http://127.0.0.1:8001")
    measure_args(p_measure)
    p_run = sub.add_parser("run", help="serve and measure in one process")
    model_args(p_run)
    p_run.add_argument("--port", type=int, default=0, help="0: any free port")
    measure_args(p_run)
    args = ap.parse_args(argv)

    from bench.loadgen import run_loop
    from bench.report import write_report

    if args.cmd == "measure":
        point = run_loop(measure(args.url, args.n, args.seed, warmup=args.warmup, budget_s=args.budget))
        write_report(_report(point, {"url": args.url}), args.out)
        print(f"wrote {args.out}", file=sys.stderr)
        return 0

    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    ckpt = resolve_checkpoint(args.checkpoint, args.model_seed, dtype)
    tts = OfficialTTS(ckpt, args.device, dtype, args.attn, args.frames_per_word)
    server = {"checkpoint": args.checkpoint, "device": args.device, "dtype": dtype, "attn": args.attn,
              "frames_per_word": args.frames_per_word, "load_s": tts.load_s}
    print(f"official model loaded in {tts.load_s:.1f}s on {args.device} ({dtype})", file=sys.stderr)
    if args.cmd == "serve":
        srv = ThreadingHTTPServer((args.host, args.port), make_handler(tts))
        print(f"serving on http://{args.host}:{srv.server_address[1]}", file=sys.stderr)
        try:
            srv.serve_forever()
        except KeyboardInterrupt:
            pass
        return 0
    srv = start_server(tts, "127.0.0.1", args.port)
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        point = run_loop(measure(url, args.n, args.seed, warmup=args.warmup, budget_s=args.budget))
    finally:
        srv.shutdown()
    write_report(_report(point, {**server, "url": url}), args.out)
    s = point["summary"]
    print(f"official: {s['ok']} requests, first audio p50 {s['latency_ms']['first_playable_ms']['p50']:.0f} ms, "
          f"{s['ms_per_frame']['p50']:.1f} ms/frame (p50), RTF {s['rtf']['p50']:.2f}", file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
