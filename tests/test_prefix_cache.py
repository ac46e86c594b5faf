"""Issue 13 item 5, prefill only what is new: the prompt-prefix cache (engine/prefix_cache.py, Runner._load_prefixes)
gives the codes of the engine without it, on the CPU in fp32; its bounds, keys, invalidation and counters."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from engine.api import ContextSpec
from engine.config import EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.model.checkpoint import load_checkpoint
from engine.model.prompt import Prompt, build_prompt, resolve_voice
from engine.model.sampling_params import SamplingParams
from engine.prefix_cache import PrefixLRU
from engine.types import AudioChunk

TEXT = list(range(3000, 3012))
INSTRUCTION = [872, 198, 4000, 4001, 4002, 4003, 4004]  # ids of "user\n" + an instruction's body
GREEDY = SamplingParams(temperature=0.0, sub_temperature=0.0, max_frames=10)
SEEDED = SamplingParams(seed=77, max_frames=10)
# (voice, language, layout, instruction, sampling): both layouts, with and without an instruction, two speakers
# (one of them a dialect speaker under auto), greedy and seeded
CASES = [("ryan", "english", "dual", None, GREEDY), ("ryan", "english", "whole", None, SEEDED),
         ("ryan", "english", "dual", INSTRUCTION, SEEDED), ("ryan", "english", "whole", INSTRUCTION, GREEDY),
         ("vivian", "auto", "dual", None, SEEDED), ("vivian", "auto", "whole", INSTRUCTION, GREEDY),
         ("eric", "auto", "dual", INSTRUCTION, GREEDY), ("vivian", "english", "dual", None, GREEDY)]


def make_engine(model, entries: int = 256, graphs: str = "off", slots: int = 12, **kw) -> Engine:
    sched = SchedulerConfig(max_slots=slots, admission_load=1e6, admission_first_audio_s=0)  # CPU: never refuse
    engine = Engine(model, EngineConfig(scheduler=sched,
                                        max_frames=32, max_prompt_tokens=64, cuda_graphs=graphs,
                                        prefix_cache_entries=entries, **kw))
    engine.warmup()
    engine.start()
    return engine


async def speak(engine, case, text=TEXT):
    voice, language, layout, instruction, sampling = case
    ctx = engine.open_context(ContextSpec(voice=voice, language=language, instruction_ids=instruction,
                                          sampling=sampling, text_layout=layout))
    ctx.append_text(text)
    ctx.close()
    chunks = [e.codes for e in [ev async for ev in ctx.events()] if isinstance(e, AudioChunk)]
    return np.concatenate(chunks)


def run_cases(engine, cases, together: bool) -> list[np.ndarray]:
    async def main():
        if together:
            return list(await asyncio.gather(*(speak(engine, c) for c in cases)))
        return [await speak(engine, c) for c in cases]

    return asyncio.run(main())


@pytest.fixture(scope="module")
def uncached(tiny_model):
    engine = make_engine(tiny_model, entries=0)
    try:
        assert not engine.runner.prefix_cache.enabled
        return run_cases(engine, CASES, together=False)
    finally:
        engine.stop()


@pytest.mark.parametrize("graphs", ["off", "emulate"])
def test_codes_with_the_cache_equal_codes_without_it(tiny_model, uncached, graphs):
    """Every case twice, one by one (the second run of each prefix copies it in), then all at once in one batch
    (hits, misses and several prefixes mixed in one prefill): the codes of the engine without a cache."""
    engine = make_engine(tiny_model, graphs=graphs)
    try:
        first = run_cases(engine, CASES, together=False)
        again = run_cases(engine, CASES, together=False)
        stats = engine.stats().prefix_cache
        together = run_cases(engine, CASES, together=True)
    finally:
        engine.stop()
    # 6 distinct prefixes (the two layouts share theirs) and the warm-up's (one miss, one hit): the first round
    # misses only where a prefix is new, the second round hits every time
    assert stats.entries == 7 and stats.misses == 1 + 6 and stats.hits == 1 + 2 + len(CASES)
    for a, b, c, ref in zip(first, again, together, uncached, strict=True):
        assert a.shape[0] == 10 and np.array_equal(a, ref) and np.array_equal(b, ref) and np.array_equal(c, ref)


def test_a_prefix_cached_for_another_speaker_would_change_the_codes(tiny_model, uncached, monkeypatch):
    """The check above has teeth: a key that forgets the codec track (speaker, language) serves ryan's English
    prefix to vivian's, and her codes then differ from the uncached ones."""
    monkeypatch.setattr(Prompt, "prefix_key", lambda self: (tuple(self.text_track[: self.prefix_len]),)
                        if self.prefix_len else None)
    engine = make_engine(tiny_model)
    try:
        ryan, vivian = run_cases(engine, [CASES[0], CASES[-1]], together=False)
        assert engine.stats().prefix_cache.hits >= 1
    finally:
        engine.stop()
    assert np.array_equal(ryan, uncached[0])
    assert not np.array_equal(vivian, uncached[-1])


def test_a_hit_prefills_one_position_in_the_smallest_graph(tiny_model):
    """Dual layout after a cached prefix: the prefill runs one position, so the length-1 prefill graph."""
    engine = make_engine(tiny_model, graphs="emulate")
    keys: list[int] = []
    bank = engine.runner.graphs.pf
    real = bank.run_split
    bank.run_split = lambda buckets, key, values: keys.append(key) or real(buckets, key, values)
    try:
        run_cases(engine, [CASES[0]] * 2, together=False)
        before = engine.runner.prefix_cache.stats().hits
        run_cases(engine, [CASES[1]], together=False)  # the whole layout shares the dual layout's prefix
        assert engine.runner.prefix_cache.stats().hits == before + 1
    finally:
        engine.stop()
    assert keys == [16, 1, 16]  # 10 positions (bucket 16), then 1; whole: 12 text + 2 positions after the prefix


def test_changed_weights_drop_every_entry(tiny_checkpoint):
    """Entries hold keys and values of one set of weights: a weight written in place drops them all, and the
    codes are those of the new weights without a cache."""
    model = load_checkpoint(tiny_checkpoint, "cpu", torch.float32)  # a private copy: its weights change here
    cached, plain = make_engine(model), make_engine(model, entries=0)
    try:
        run_cases(cached, CASES[:2], together=False)
        assert cached.stats().prefix_cache.entries == 2  # the warm-up's and ryan's
        with torch.no_grad():
            model.tts.talker.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
        after = run_cases(cached, CASES[:2], together=False)
        stats = cached.stats().prefix_cache
        reference = run_cases(plain, CASES[:2], together=False)
    finally:
        cached.stop()
        plain.stop()
    assert stats.invalidations == 1 and stats.entries == 1 and stats.hits == 1 + 1 + 1  # warm-up, before, after
    for a, b in zip(after, reference, strict=True):
        assert np.array_equal(a, b)


def test_prefix_of_a_prompt(tiny_model):
    cfg = tiny_model.config
    ryan, vivian = resolve_voice(cfg, "ryan", "english"), resolve_voice(cfg, "vivian", "english")
    instruction = [cfg.im_start_id, *INSTRUCTION, cfg.im_end_id, 198]
    dual = build_prompt(cfg, ryan, TEXT, "dual")
    whole = build_prompt(cfg, ryan, TEXT, "whole")
    assert dual.prefix_len == whole.prefix_len == 9 == len(dual) - 1  # role 3 + codec head 6; dual: 1 more
    assert dual.prefix_key() == whole.prefix_key() == build_prompt(cfg, ryan, [5], "dual").prefix_key()
    assert dual.codec_track[dual.prefix_len] == cfg.talker.codec_bos_id  # the first position that reads text
    keys = {dual.prefix_key(), build_prompt(cfg, vivian, TEXT, "dual").prefix_key(),
            build_prompt(cfg, resolve_voice(cfg, "ryan", "auto"), TEXT, "dual").prefix_key(),
            build_prompt(cfg, resolve_voice(cfg, "eric", "auto"), TEXT, "dual").prefix_key(),
            build_prompt(cfg, resolve_voice(cfg, "eric", "english"), TEXT, "dual").prefix_key(),
            build_prompt(cfg, ryan, TEXT, "dual", instruction).prefix_key()}
    assert len(keys) == 6  # speaker, language, dialect and instruction each make another prefix
    with_instruction = build_prompt(cfg, ryan, TEXT, "whole", instruction)
    assert with_instruction.prefix_len == len(instruction) + 9
    assert Prompt([1, 2], [-1, -1]).prefix_key() is None
    assert Prompt([1, 2], [-1, -1], prefix_len=2).prefix_key() is None  # nothing after it to prefill


def test_lru_bounds_and_counters():
    lru: PrefixLRU[str] = PrefixLRU(max_entries=2, max_bytes=100)
    assert lru.lookup("a") is None
    assert lru.insert("a", "A", 40) and lru.insert("b", "B", 40)
    assert lru.lookup("a") == "A"  # a is now the most recent: b goes first
    assert lru.insert("c", "C", 10)
    assert "b" not in lru and len(lru) == 2 and lru.bytes == 50
    assert lru.insert("d", "D", 95)  # the byte bound evicts both others
    assert len(lru) == 1 and lru.bytes == 95
    assert not lru.insert("e", "E", 101)  # larger than the whole bound: not kept, nothing evicted
    s = lru.stats()
    assert (s.hits, s.misses, s.evictions, s.entries, s.bytes, s.max_entries, s.max_bytes) == (1, 1, 3, 1, 95, 2, 100)
    lru.invalidate()
    assert lru.stats().entries == 0 and lru.stats().bytes == 0 and lru.stats().invalidations == 1
    with pytest.raises(ValueError):
        lru.insert("n", None, 1)  # None is lookup's "not there"
    off = PrefixLRU(0, 100)
    assert not off.enabled and not off.insert("a", "A", 1) and len(off) == 0
