"""An engine without a model, for tests of the server's own decisions: it reports a model and its readiness, and
no context may reach it."""

from __future__ import annotations

import contextlib

from engine import FastPath, ModelInfo, Readiness, SamplingParams, VoiceInfo


class FakeEngine:
    def __init__(self, *, supports_instructions: bool = True, running: bool = True):
        self._running = running
        self.sampling_defaults = SamplingParams()
        self.info = ModelInfo(name="fake", model_size="1b7" if supports_instructions else "0b6",
                              voices=[VoiceInfo("ryan", ["auto", "english"])], languages=["auto", "english"],
                              supports_instructions=supports_instructions, random_weights=True,
                              sampling_defaults=self.sampling_defaults)

    def readiness(self) -> Readiness:
        off = FastPath(False, "fake")
        return Readiness(model_loaded=True, warmed_up=True, engine_running=self._running, device="cpu",
                         dtype="float32", cuda_graphs=off, triton_kernels=off, random_weights=True)

    def running(self) -> bool:
        return self._running

    def attach(self, loop) -> None:
        pass

    def open_context(self, spec):
        raise AssertionError("this test's requests must be answered before the engine")

    open_context_pipelined = open_context

    def coalesced(self):
        return contextlib.nullcontext()

    def end_pacing(self) -> None:
        pass

    def stop(self) -> None:
        pass
