"""Step costs for the simulator, from a measured stage profile (the JSON engine/tools/profile_stages.py writes).

A profile row is the median wall time of one stage alone at one batch size (codec: and one chunk size). The
simulator asks for batches and chunk sizes that were not measured: the batch is first padded to its CUDA-graph
bucket (a power of two, as the runner pads it), then the time is interpolated linearly between the measured
batches around it (extrapolated from the last two above the largest); the codec is interpolated the same way
between measured chunk sizes. The prefill is costed at one prompt length (the smallest measured unless told):
the graphs' prefill time is kernel count, not positions, and the profile's longer prompts may have run eagerly.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

from engine.types import Stage

DEFAULT_PROFILE = Path(__file__).resolve().parents[2] / "docs/benchmarks/h200/stages_1p7b_after.json"


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
    tables: dict[Stage, dict[int, list[tuple[float, float]]]]  # stage -> chunk (0: not codec) -> [(batch, s)]
    pad_to_buckets: bool = True

    @classmethod
    def from_json(cls, path: str | Path = DEFAULT_PROFILE, graphs: str = "on", prompt_len: int | None = None,
                  pad_to_buckets: bool = True) -> StageProfile:
        data = json.loads(Path(path).read_text())
        rows = [r for r in data.get("rows", []) if r.get("graphs", "on") == graphs]
        prefill_lens = sorted({r["prompt_len"] for r in rows if r["stage"] == "prefill"})
        if prompt_len is None and prefill_lens:
            prompt_len = prefill_lens[0]
        tables: dict[Stage, dict[int, list[tuple[float, float]]]] = {s: {} for s in Stage}
        for r in rows:
            if r["stage"] == "prefill" and r["prompt_len"] != prompt_len:
                continue
            chunk = int(r.get("chunk", 0)) if r["stage"] == "codec" else 0
            tables[Stage(r["stage"])].setdefault(chunk, []).append((float(r["batch"]), r["ms"] / 1e3))
        for stage, by_chunk in tables.items():
            if not by_chunk:
                raise ProfileError(f"{path}: no {stage.value} rows with graphs={graphs!r}"
                                   + (f" and prompt_len={prompt_len}" if stage == Stage.PREFILL else ""))
            for points in by_chunk.values():
                points.sort()
        return cls(str(path), tables, pad_to_buckets)

    def step_s(self, stage: Stage, batch: int, chunk: int = 0) -> float:
        """Device seconds of one step of `batch` rows (codec: of `chunk` frames each)."""
        if batch < 1:
            raise ValueError(f"batch {batch}: a step has at least one row")
        x = float(graph_bucket(batch) if self.pad_to_buckets else batch)
        by_chunk = self.tables[stage]
        if stage != Stage.CODEC:
            return _interp(by_chunk[0], x)
        return _interp([(float(c), _interp(points, x)) for c, points in sorted(by_chunk.items())], float(chunk))
