"""Issue 13 item 6, capacity: 128 slots where KV memory allows. max_slots 0 (auto) sizes the slots from the device's
free memory (at most 128), graph buckets go up to 128, and the scheduler, admission and the emulated graphs run 128
streams at once on the CPU."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.api import ContextSpec, Overloaded
from engine.config import MAX_SLOTS, EngineConfig, EngineConfigError, SchedulerConfig
from engine.cost_model import CostModel
from engine.engine import Engine
from engine.graphs import GraphBank
from engine.model.config import ModelConfig
from engine.model.presets import model_config
from engine.model.sampling_params import SamplingParams
from engine.runner import AUTO_RESERVE_BYTES, CPU_AUTO_SLOTS, auto_slots, resolve_slots, slot_bytes
from engine.types import AudioChunk, Stage

GIB = 1 << 30


def full_size(device: str = "cuda") -> SimpleNamespace:
    """What auto_slots reads of a loaded 1.7B model in bf16 (the codec state of about 1.3 M values per stream)."""
    return SimpleNamespace(config=ModelConfig.from_dict(model_config("1.7b")), dtype=torch.bfloat16,
                           device=torch.device(device), codec=SimpleNamespace(state_layout=SimpleNamespace(
                               width=1_300_000)))


def test_a_slot_of_the_full_model_is_its_kv_rows_and_codec_state():
    cfg = EngineConfig()
    per_slot = slot_bytes(full_size(), cfg)
    kv = 114_688 * cfg.kv_len  # docs/model.md 8: Talker KV per position in bf16
    assert kv < per_slot < kv + 4 * 2**20


def test_auto_slots_follow_the_free_device_memory(monkeypatch):
    cfg = EngineConfig()  # max_slots 0: auto
    loaded, per_slot = full_size(), slot_bytes(full_size(), cfg)
    free = {"bytes": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 141 * GIB))

    free["bytes"] = 134 * GIB  # an H200 after the load: 128 fit with room to spare
    assert auto_slots(loaded, cfg) == MAX_SLOTS
    free["bytes"] = 19 * GIB  # a 24 GB card: what the memory holds beside the reserve and the prefix cache
    expected = (19 * GIB - AUTO_RESERVE_BYTES - cfg.prefix_cache_bytes) // per_slot - 1
    assert auto_slots(loaded, cfg) == expected and 8 < expected < 64
    shorter = EngineConfig(max_frames=512)  # a shorter KV cache: more slots in the same memory
    assert auto_slots(loaded, shorter) > 2 * expected
    free["bytes"] = 8 * GIB
    with pytest.raises(EngineConfigError, match="--max-frames"):
        auto_slots(loaded, cfg)
    explicit = cfg.with_slots(200)  # an explicit number is kept, even above the auto cap
    assert resolve_slots(explicit, loaded) is explicit
    free["bytes"] = 134 * GIB
    assert resolve_slots(cfg, loaded).scheduler.max_slots == MAX_SLOTS


def test_auto_slots_on_a_cpu_stay_at_64(tiny_model):
    assert auto_slots(tiny_model, EngineConfig()) == CPU_AUTO_SLOTS
    assert SchedulerConfig().slots == MAX_SLOTS  # a scheduler without an engine (the simulator)


def test_predictions_count_every_step_a_batch_limit_makes():
    costs = CostModel({"talker": 64, "code_predictor": 64, "codec": 64, "prefill": 16})
    for batch in (1, 8, 64):
        costs.observe(Stage.TALKER, batch, 0.006 + 0.0001 * batch)
        costs.observe(Stage.CODE_PREDICTOR, batch, 0.004 + 0.0001 * batch)
    one_step = costs.step_s(Stage.TALKER, 128)
    assert costs.rows_s(Stage.TALKER, 128) == pytest.approx(2 * costs.step_s(Stage.TALKER, 64))
    assert costs.rows_s(Stage.TALKER, 128) > one_step  # two fixed costs, not one
    assert costs.rows_s(Stage.TALKER, 100) == pytest.approx(costs.step_s(Stage.TALKER, 64)
                                                            + costs.step_s(Stage.TALKER, 36))
    assert costs.rows_s(Stage.TALKER, 40) == costs.step_s(Stage.TALKER, 40)
    assert CostModel().rows_s(Stage.TALKER, 128) is None


def test_128_streams_at_once_with_emulated_graphs(tiny_model):
    """128 slots: the batch buckets reach 128, admission takes 128 contexts and refuses the 129th, each stage
    steps all 128 rows in its 128 bucket, and the padded graph path gives the eager engine's codes."""
    sampling = [SamplingParams(temperature=0.0, sub_temperature=0.0, max_frames=10) if i % 2 else
                SamplingParams(seed=i, max_frames=10) for i in range(MAX_SLOTS)]
    voices = ("ryan", "vivian", "serena", "eric")

    def run(mode: str):
        sched = SchedulerConfig(max_slots=MAX_SLOTS, admission_load=1e6, admission_first_audio_s=0,
                                max_waiting_first_audio=MAX_SLOTS + 1, max_step_s=0,  # CPU steps are long
                                # one prefill of all 128, so they all step together (16 at a time, each group
                                # would run dry on a CPU and stay ahead of the rest)
                                max_batch={"prefill": MAX_SLOTS, "talker": MAX_SLOTS, "code_predictor": MAX_SLOTS,
                                           "codec": MAX_SLOTS})
        engine = Engine(tiny_model, EngineConfig(scheduler=sched, max_frames=10, max_prompt_tokens=32,
                                                 cuda_graphs=mode))
        buckets: list[tuple[str, int, int]] = []
        if mode == "emulate":
            engine.capture_graphs()
            real = GraphBank.run

            def spy(bank, bucket, key, n, values):
                buckets.append((bank.name, bucket, n))
                return real(bank, bucket, key, n, values)

            graphs = engine.runner.graphs
            for bank in (graphs.pf, graphs.tk, graphs.cp, graphs.cd):
                bank.run = spy.__get__(bank)

        async def main():
            contexts = [engine.open_context(ContextSpec(voice=voices[i % 4], language="english", sampling=s))
                        for i, s in enumerate(sampling)]
            with pytest.raises(Overloaded, match=f"all {MAX_SLOTS} slots"):
                engine.open_context(ContextSpec(voice="ryan", sampling=sampling[0]))
            for i, ctx in enumerate(contexts):  # all the text first: every stream is runnable at once
                ctx.append_text(list(range(3000 + i % 7, 3006 + i % 7)))
                ctx.close()
            engine.start()
            out = []
            for ctx in contexts:
                chunks = [e.codes for e in [ev async for ev in ctx.events()] if isinstance(e, AudioChunk)]
                out.append(np.concatenate(chunks))
            return out

        try:
            return asyncio.run(main()), engine, buckets
        finally:
            engine.stop()

    eager, _, _ = run("off")
    padded, engine, buckets = run("emulate")
    assert engine.readiness().cuda_graphs.batch_buckets == [1, 2, 4, 8, 16, 32, 64, 128]
    for stage in ("prefill", "code_predictor", "talker", "codec"):
        assert (stage, 128, 128) in buckets, stage
    assert engine.stats().max_slots == MAX_SLOTS
    for a, b in zip(eager, padded, strict=True):
        assert a.shape == (10, 16) and np.array_equal(a, b)
