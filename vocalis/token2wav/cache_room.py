"""Room in the token2wav cache budget for streams about to start their caches (`CacheRoom`), used by
`Token2WavEngine.step` when `Token2WavConfig.wait_for_cache` is on."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vocalis.token2wav.engine import Token2WavEngine
    from vocalis.token2wav.state import StreamState


class CacheRoom:
    """What the cache budget leaves for streams starting their caches in one step: the budget minus the caches
    held and every started stream's next hop (reserved, so that starting new streams does not push the started
    ones into recomputing). Computed on first use."""

    def __init__(self, engine: Token2WavEngine) -> None:
        self.engine = engine
        self.free: int | None = None
        self.per_token = self.per_stream = 0
        self.started = False

    def take(self, s: StreamState) -> bool:
        """Reserve room for `s`'s first chunk; True if it starts now. A stream always starts when no other
        stream holds caches (then none that ends would make room for it)."""
        e = self.engine
        if self.free is None:
            self.per_token, self.per_stream = e.cache_bytes_per_token(), e.cache_bytes_per_stream()
            started = e.started_streams()
            self.started = bool(started)
            growing = [t for t in started if e.next_work(t) != "final"]  # a final chunk keeps no cache
            self.free = e.cache_budget - e.live_cache_bytes() - sum(e.growth(t, self.per_token, 0) for t in growing)
        # its first chunk, and the hop after it reserved as for the started streams
        after = min(e.stream.token_max_hop_len, s.hop * e.stream.stream_scale_factor)
        need = e.growth(s, self.per_token, self.per_stream) + after * self.per_token
        prefix = e.cacheable_prefix(s.num_prompt_tokens) if e.config.voice_cache_size else 0
        if prefix and not e.has_voice_prefix(s.prompt):  # its voice's prefix is computed with it
            need += prefix * self.per_token + self.per_stream
        if self.started and need > self.free:
            return False
        self.free -= need
        self.started = True
        return True
