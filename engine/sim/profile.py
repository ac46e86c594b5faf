"""Step costs for the simulator, from a measured stage profile (the JSON engine/tools/profile_stages.py writes).

A profile row is the median wall time of one stage alone at one batch size (codec: and one chunk size). The
simulator asks for batches and chunk sizes that were not measured: the batch is first padded to its CUDA-graph
bucket (a power of two, as the runner pads it), then the time is interpolated linearly between the measured
batches around it (extrapolated from the last two above the largest); the codec is interpolated the same way
between measured chunk sizes. A whole prompt's prefill is costed at one prompt length (the smallest measured
unless told): the graphs' prefill time is kernel count, not positions, and the profile's longer prompts may have
run eagerly. A prefill of fewer positions (a prompt after its cached prefix: one position in the dual layout) is
interpolated between the measured lengths up to that one and, where no 1-position prefill was measured, a
1-position point that stands in for it: the Talker step at the same batch (the same 28 layers over one position
each), never above the shortest measured prefill. That stand-in is a model; profile_stages --cached-lens 1 measures
the real thing. Prefill rows are placed at the positions they ran (`positions`; profiles before it give only
`prompt_len`, the text tokens of a whole-layout prompt about 10 positions shorter, which stands in).

A FIRST_AUDIO step (prefill, Code Predictor and a 1-frame codec chunk in one launch) is read from its own rows
where the profile has them (profile_stages --stages first_audio); otherwise it costs its three parts' sum, each
at the same batch, the prefill at the positions it runs.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

from engine.types import Stage

# The newest H200 profile with every stage the simulator reads (FIRST_AUDIO steps and 1-position prefills included):
# a prediction from an older profile is a prediction for an older engine (stages_1p7b_after.json said 115 ms p95 at
# 10 RPS where 78cded6's says 11.8 and the H200 measured 12.6).
DEFAULT_PROFILE = Path(__file__).resolve().parents[2] / "docs/benchmarks/h200/stages_1p7b_78cded6.json"


class ProfileError(ValueError):
    pass


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through sorted (x, y) points; flat below the first, the last slope above the last."""
    if len(points) == 1 or x <= points[0][0]:
        return points[0][1]
    i = bisect_left([p[0] for p in points], x)
    if i >= len(points):
        i = len(points) - 1
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def graph_bucket(batch: int) -> int:
    """The CUDA-graph batch bucket a batch is padded to (1, 2, 4, ...)."""
    return 1 << max(0, batch - 1).bit_length()


@dataclass
class StageProfile:
    """Seconds per step by stage, batch (and codec chunk), from measured rows."""

    source: str
    # stage -> chunk (codec: frames; prefill: prompt positions; else 0) -> [(batch, s)]
    tables: dict[Stage, dict[int, list[tuple[float, float]]]]
    pad_to_buckets: bool = True
    prompt_len: int = 0  # the positions a whole prompt's prefill is costed at (longer ones cost the same)

    @classmethod
    def from_json(cls, path: str | Path = DEFAULT_PROFILE, graphs: str = "on", prompt_len: int | None = None,
                  pad_to_buckets: bool = True) -> StageProfile:
        data = json.loads(Path(path).read_text())
        rows = [r for r in data.get("rows", []) if r.get("graphs", "on") == graphs]
        # whole prompts: rows measured without a cached prefix (profile_stages --cached-lens rows have one)
        prefill_lens = sorted({r["prompt_len"] for r in rows
                               if r["stage"] == "prefill" and not r.get("cached_prefix")})
        if prompt_len is None and prefill_lens:
            prompt_len = prefill_lens[0]
        tables: dict[Stage, dict[int, list[tuple[float, float]]]] = {s: {} for s in Stage}
        whole = 0  # the positions the chosen whole prompt ran
        for r in rows:
            chunk = int(r.get("chunk", 0))
            if r["stage"] == "prefill":
                if not r.get("cached_prefix") and r["prompt_len"] != prompt_len:
                    continue
                chunk = int(r.get("positions", r["prompt_len"]))  # older profiles: text tokens stand in
                if not r.get("cached_prefix"):
                    whole = chunk
            points = tables[Stage(r["stage"])].setdefault(chunk, [])
            if all(b != r["batch"] for b, _ in points):  # one row per batch (a second run of it is ignored)
                points.append((float(r["batch"]), r["ms"] / 1e3))
        for stage, by_chunk in tables.items():
            if not by_chunk and stage != Stage.FIRST_AUDIO:  # (optional: its parts' sum stands in)
                raise ProfileError(f"{path}: no {stage.value} rows with graphs={graphs!r}"
                                   + (f" and prompt_len={prompt_len}" if stage == Stage.PREFILL else ""))
            for points in by_chunk.values():
                points.sort()
        return cls(str(path), tables, pad_to_buckets, whole)

    def step_s(self, stage: Stage, batch: int, chunk: int = 0) -> float:
        """Device seconds of one step of `batch` rows (codec: of `chunk` frames each; prefill: of `chunk` prompt
        positions each, 0: a whole prompt)."""
        if batch < 1:
            raise ValueError(f"batch {batch}: a step has at least one row")
        x = float(graph_bucket(batch) if self.pad_to_buckets else batch)
        by_chunk = self.tables[stage]
        if stage == Stage.FIRST_AUDIO:
            if by_chunk:  # measured at one prompt (chunk: its positions); a chain's prefill rarely differs
                return _interp(by_chunk[min(by_chunk)], x)
            return (self.step_s(Stage.PREFILL, batch, chunk) + self.step_s(Stage.CODE_PREDICTOR, batch)
                    + self.step_s(Stage.CODEC, batch, 1))
        if stage == Stage.PREFILL:
            lengths = {n: _interp(points, x) for n, points in by_chunk.items() if n <= self.prompt_len}
            if 1 not in lengths:  # no 1-position prefill measured: a Talker step's cost stands in (module doc)
                lengths[1] = min(_interp(self.tables[Stage.TALKER][0], x), lengths[min(lengths)])
            n = min(chunk or self.prompt_len, max(lengths))
            return _interp(sorted((float(k), v) for k, v in lengths.items()), float(max(n, 1)))
        if stage != Stage.CODEC:
            return _interp(by_chunk[0], x)
        return _interp([(float(c), _interp(points, x)) for c, points in sorted(by_chunk.items())], float(chunk))
