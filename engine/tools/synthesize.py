"""Synthesize one utterance with the eager reference loop and write it as a 24 kHz mono WAV.

    python -m engine.tools.synthesize --model DIR --text TEXT --voice V --language L [--instructions I]
        [--greedy] [--seed N] [--max-frames N] [--text-layout dual|whole] --out OUT.wav [--codes-out CODES.npy]
"""

from __future__ import annotations

import argparse
import sys
import time
import wave

import numpy as np
import torch

from engine.model.checkpoint import load_checkpoint
from engine.model.generate import Frame, GenerationRequest, generate
from engine.model.prompt import LAYOUTS, PromptError, build_prompt, instruction_ids, resolve_voice
from engine.model.sampling_params import SamplingError, SamplingParams
from engine.model_source import is_random_checkpoint
from engine.text.tokenizer import TextTokenizer

SAMPLE_RATE = 24000
# Random weights never end an utterance: without a cap one runs to the model's frame limit (2048 frames, 164 s of
# noise for "Hello there."). Capped like the server's benchmark length mode for random models.
RANDOM_FRAMES_PER_WORD = 5


def write_wav(path: str, pcm: np.ndarray) -> None:
    s16 = np.clip(np.round(pcm * 32767.0), -32768, 32767).astype("<i2")
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(s16.tobytes())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--text", required=True)
    ap.add_argument("--voice", required=True)
    ap.add_argument("--language", default="auto")
    ap.add_argument("--instructions", default=None, help="style instruction (1.7B only)")
    ap.add_argument("--greedy", action="store_true", help="temperature 0 for the Talker and the Code Predictor")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-frames", type=int, default=None, help="complete frames at most (80 ms each); default: "
                    f"the model's limit, or {RANDOM_FRAMES_PER_WORD} per word for random weights")
    ap.add_argument("--text-layout", choices=LAYOUTS, default="dual")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--out", required=True, help="output WAV (24 kHz mono, 16-bit)")
    ap.add_argument("--codes-out", default=None, help="codes as an int array [frames, 16] (.npy)")
    args = ap.parse_args(argv)

    loaded = load_checkpoint(args.model, args.device, getattr(torch, args.dtype))
    if loaded.tokenizer_dir is None:
        ap.error(f"{args.model} has no text tokenizer files (tokenizer.json or vocab.json + merges.txt)")
    tokenizer = TextTokenizer.from_dir(loaded.tokenizer_dir)
    cfg = loaded.config
    max_frames = args.max_frames
    if max_frames is None and (loaded.random_weights or is_random_checkpoint(args.model)):
        max_frames = max(1, RANDOM_FRAMES_PER_WORD * len(args.text.split()))
        print(f"random weights (noise, not speech): capped at {max_frames} frames, {RANDOM_FRAMES_PER_WORD} per "
              "word (--max-frames to change)", file=sys.stderr)
    try:
        voice = resolve_voice(cfg, args.voice, args.language)
        instr = instruction_ids(cfg, tokenizer.encode("user\n" + args.instructions)) if args.instructions else None
        sampling = SamplingParams.from_generation_config(cfg.generation).with_overrides(
            seed=args.seed, max_frames=max_frames, **({"temperature": 0.0} if args.greedy else {}))
        text_ids = tokenizer.encode(args.text)
        prompt = build_prompt(cfg, voice, text_ids, args.text_layout, instr)
    except (PromptError, SamplingError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.time()
    request = GenerationRequest(prompt, text_ids, args.text_layout, sampling)
    frames = [e.codes for e in generate(loaded.tts, [request]) if isinstance(e, Frame)]
    codes = torch.stack(frames) if frames else torch.zeros(0, 16, dtype=torch.int64)
    with torch.inference_mode():
        pcm = loaded.codec(codes.T[None].to(loaded.device)).float().flatten().cpu().numpy() if frames else np.zeros(0)
    write_wav(args.out, pcm)
    if args.codes_out:
        np.save(args.codes_out, codes.numpy())
    seconds = len(pcm) / SAMPLE_RATE
    print(f"{len(frames)} frames, {seconds:.2f} s of audio in {time.time() - t0:.2f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
