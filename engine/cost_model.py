"""Step-time model for admission: per stage, time = fixed + per_row * work, fitted online. No torch.

Work is the batch size, except for the codec, whose cost grows with frames decoded: there it is rows x frames
per row, so steps of every chunk size of the ramp fit one line."""

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
    def __init__(self) -> None:
        self.fits = {stage: _LinearFit() for stage in Stage}

    def observe(self, stage: Stage, batch: int, seconds: float, frames_per_row: int = 1) -> None:
        if batch > 0:
            self.fits[stage].observe(batch * (frames_per_row if stage == Stage.CODEC else 1), seconds)

    def step_s(self, stage: Stage, batch: int, frames_per_row: int = 1) -> float | None:
        return self.fits[stage].predict(batch * (frames_per_row if stage == Stage.CODEC else 1))

    def round_s(self, streams: int, frames_per_codec_chunk: int) -> float | None:
        """Predicted time to give `streams` concurrent streams one more frame each (None: nothing measured)."""
        talker = self.step_s(Stage.TALKER, streams)
        cp = self.step_s(Stage.CODE_PREDICTOR, streams)
        if talker is None or cp is None:
            return None
        chunk = max(1, frames_per_codec_chunk)
        codec = self.step_s(Stage.CODEC, streams, chunk) or 0.0
        return talker + cp + codec / chunk
