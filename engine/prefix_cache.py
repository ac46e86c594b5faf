"""The prompt-prefix cache's policy: a bounded LRU of prompt prefixes, by entry count and bytes. Plain Python: no torch.

A Talker prompt opens with positions that do not depend on the utterance's text (instruction, role, the codec tags
with language and speaker; `Prompt.prefix_len`). Attention is causal, so their keys and values depend on those
positions alone: the runner keeps them once per distinct prefix (`Prompt.prefix_key()`, the ids of both tracks,
which is everything that shapes them: voice, language, dialect, instruction; the dual and whole layouts share a
prefix) and copies them into a newcomer's cache row, whose prefill then runs only the positions after it. The
runner stores tensors here (engine/runner.py), the simulator only sizes (engine/sim/device.py): both count
hits, misses and evictions the same way. Entries are valid for one set of weights: `invalidate` drops them all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

from engine.model.prompt import Prompt
from engine.types import PrefixCacheStats

V = TypeVar("V")


class PrefixLRU(Generic[V]):
    """Least recently used prefixes, at most `max_entries` of them and `max_bytes` in all (0 in either: off)."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()  # key -> (value, bytes), oldest first
        self.bytes = 0
        self.hits = self.misses = self.evictions = self.invalidations = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def lookup(self, key: Hashable) -> V | None:
        """The value cached for `key` (now the most recently used), counted as a hit; None, counted as a miss."""
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return found[0]

    def insert(self, key: Hashable, value: V, nbytes: int) -> bool:
        """Keep `value` (never None: lookup's "not there") for `key`, evicting the least recently used entries to
        stay within both bounds. An entry larger than the byte bound is not kept (False)."""
        if value is None:
            raise ValueError("a cached value cannot be None")
        if not self.enabled or nbytes > self.max_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        while self._entries and (len(self._entries) >= self.max_entries or self.bytes + nbytes > self.max_bytes):
            _, (_, size) = self._entries.popitem(last=False)
            self.bytes -= size
            self.evictions += 1
        self._entries[key] = (value, nbytes)
        self.bytes += nbytes
        return True

    def find(self, prompts: Sequence[Prompt]) -> tuple[list[int], dict[tuple, tuple[V, list[int]]]]:
        """One prefill's rows: per prompt the positions its cached prefix covers (0: a miss, or no prefix), and
        each prefix found with its value and the rows (indices into `prompts`) that use it. Off: all 0."""
        starts: list[int] = []
        found: dict[tuple, tuple[V, list[int]]] = {}
        for i, prompt in enumerate(prompts):
            key = prompt.prefix_key() if self.enabled else None
            value = self.lookup(key) if key is not None else None
            starts.append(prompt.prefix_len if value is not None else 0)
            if value is not None:
                found.setdefault(key, (value, []))[1].append(i)
        return starts, found

    def keep(self, prompts: Sequence[Prompt], starts: list[int], make: Callable[[int, Prompt], tuple[V, int]]) -> None:
        """After the prefill `find` planned: keep the prefix of each row that missed, once per new prefix;
        make(row index, prompt) -> (value, bytes)."""
        if not self.enabled:
            return
        for i, (prompt, start) in enumerate(zip(prompts, starts, strict=True)):
            key = prompt.prefix_key()
            if not start and key is not None and key not in self:
                self.insert(key, *make(i, prompt))

    def invalidate(self) -> None:
        """Drop every entry (the weights they were computed with changed)."""
        if self._entries:
            self.invalidations += 1
        self._entries.clear()
        self.bytes = 0

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(hits=self.hits, misses=self.misses, evictions=self.evictions,
                                invalidations=self.invalidations, entries=len(self._entries), bytes=self.bytes,
                                max_entries=self.max_entries, max_bytes=self.max_bytes)
