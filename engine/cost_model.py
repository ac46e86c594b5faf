"""Step-time model for admission: per stage, time = fixed + per_row * work, fitted online. No torch.

Work is the batch size, except for the codec, whose cost grows with frames decoded: there it is rows x frames
per row, so steps of every chunk size of the ramp fit one line. A codec step whose rows decode different chunks
runs padded to the largest, and is priced (and observed) at that size."""

from __future__ import annotations

from engine.types import Stage

DECAY = 0.98  # weight of the past per observation (about the last 50 steps matter)


class _LinearFit:
    """Exponentially weighted least squares of t = a + b * x."""

    def __init__(self) -> None:
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, x: float, y: float) -> None:
        d = DECAY
        self.w, self.sx, self.sy = d * self.w + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def predict(self, x: float) -> float | None:
        if self.w < 1:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        slope = max(0.0, (self.sxy / self.w - mx * my) / var) if var > 1e-9 else 0.0
        if var <= 1e-9 and mx > 0:
            slope = my / mx / 10  # one batch size seen so far: weights are shared, so assume little growth
        return max(0.0, my + slope * (x - mx))


class CostModel:
    def __init__(self, max_batch: dict[str, int] | None = None) -> None:
        self.max_batch = dict(max_batch or {})  # stage name -> rows one step takes at most (none: no limit)
        self.reset()

    def reset(self) -> None:
        """Forget every observation (the warm-up's first calls must not steer admission)."""
        self.fits = {stage: _LinearFit() for stage in Stage}

    def observe(self, stage: Stage, batch: int, seconds: float, frames_per_row: int = 1) -> None:
        if batch > 0:
            self.fits[stage].observe(batch * (frames_per_row if stage == Stage.CODEC else 1), seconds)

    def step_s(self, stage: Stage, batch: int, frames_per_row: int = 1) -> float | None:
        return self.fits[stage].predict(batch * (frames_per_row if stage == Stage.CODEC else 1))

    def rows_s(self, stage: Stage, rows: int, frames_per_row: int = 1) -> float | None:
        """Predicted time of `rows` rows at a stage, in as many steps as its max_batch needs: full steps, then
        one of the rest (128 streams at a 64-row limit are two steps, each with its fixed cost)."""
        limit = self.max_batch.get(stage.value, 0)
        if not limit or rows <= limit:
            return self.step_s(stage, rows, frames_per_row)
        full, rest = divmod(rows, limit)
        step, tail = self.step_s(stage, limit, frames_per_row), self.step_s(stage, rest, frames_per_row) if rest else 0
        return None if step is None or tail is None else full * step + tail

    def round_s(self, streams: int, frames_per_codec_chunk: int) -> float | None:
        """Predicted time to give `streams` concurrent streams one more frame each (None: nothing measured)."""
        talker = self.rows_s(Stage.TALKER, streams)
        cp = self.rows_s(Stage.CODE_PREDICTOR, streams)
        if talker is None or cp is None:
            return None
        chunk = max(1, frames_per_codec_chunk)
        codec = self.rows_s(Stage.CODEC, streams, chunk) or 0.0
        return talker + cp + codec / chunk
