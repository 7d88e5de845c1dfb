"""The voice-prefix cache, one for every family: a voice's leading prompt frames neither look ahead into nor share
an attention block with generated tokens, so their flow caches are computed once per voice and every request of
that voice continues them read only, storing only its own frames (what an entry holds is the family's:
`cv2.voice_prefix.VoicePrefix`, CosyVoice 3's DiT caches per Euler step).

An entry is reference-counted by the live requests using it: it stays while one does, and once idle it is kept
only among the `size` most recently used (a saved voice's next request skips it again).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, ValuesView
from typing import Generic, TypeVar

from vocalis.frontend.prompt import FlowPrompt
from vocalis.token2wav.protocol import Token2WavStats

E = TypeVar("E")  # a family's prefix entry


def voice_key(prompt: FlowPrompt) -> str:
    h = hashlib.sha1()
    for t in (prompt.speech_ids, prompt.mel, prompt.embedding):
        h.update(t.detach().to("cpu").contiguous().float().numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()


class VoiceCache(Generic[E]):
    """Prefix entries by voice key, least recently used first."""

    def __init__(self, size: int, stats: Token2WavStats, in_use: Callable[[], Iterable[E | None]]) -> None:
        """size: idle entries kept; in_use: the entries live requests hold now."""
        self.size = size
        self.stats = stats
        self._in_use = in_use
        self._entries: OrderedDict[str, E] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def values(self) -> ValuesView[E]:
        return self._entries.values()

    def lookup(self, key: str, compute: Callable[[], E]) -> E:
        """The voice's entry, computed on its first use (a miss) and last used now."""
        entry = self._entries.get(key)
        if entry is None:
            self.stats.voice_cache_misses += 1
            entry = compute()
            self._entries[key] = entry
        else:
            self.stats.voice_cache_hits += 1
            self._entries.move_to_end(key)
        self.trim(keep=entry)
        return entry

    def released(self, entry: E | None) -> None:
        """A request using `entry` ended (or dropped it): last used now; the idle ones beyond `size` go."""
        if entry is not None:
            for key, held in self._entries.items():
                if held is entry:
                    self._entries.move_to_end(key)
                    break
        self.trim()

    def trim(self, keep: E | None = None) -> None:
        """Forget the least recently used idle entries beyond `size`; an entry some live request uses stays (that
        request references its tensors anyway, and the voice's next request shares it)."""
        if len(self._entries) <= self.size:
            return
        in_use = {id(e) for e in self._in_use() if e is not None}
        idle = [key for key, entry in self._entries.items() if entry is not keep and id(entry) not in in_use]
        for key in idle[: max(0, len(idle) - self.size)]:  # oldest first
            del self._entries[key]
