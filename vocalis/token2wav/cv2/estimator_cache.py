"""What a request keeps per Euler step of the incremental estimator (`EstimatorCache`): the keys/values of every
transformer block and the input tails of every causal conv over its frames so far (why exactly these:
`token2wav.cv2.estimator`). Memory per cached frame, at the 0.5B shapes:
56 blocks x (K + V = 2 x 512) x 2 guidance rows x 10 steps = 1.15 M values (4.6 MB in fp32); a request's
cache is dropped when it finishes, and a voice's prompt prefix is shared (`EstimatorCache.prefix`), never copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class EstimatorCache:
    """One request at one Euler step: keys/values per transformer block and input tails per causal conv.

    Tensors are (2, ...) with the conditional row first; they are replaced, never written in place. Requests
    extended in one uniform step hold views (their row pairs) of one whole-batch tensor: a finished request's
    slice is freed when the others of that step replace theirs (their next chunk or their end).
    A request that starts from a voice's shared prompt prefix points at it (`prefix`, read only, shared by every
    request of that voice) and holds only its own frames [prefix.num_frames, num_frames) in `keys`/`values`,
    so its memory is its own frames, not the prompt's again.
    """

    keys: list[torch.Tensor] = field(default_factory=list)  # per block (2, H, own frames, E)
    values: list[torch.Tensor] = field(default_factory=list)
    tails: list[torch.Tensor] = field(default_factory=list)  # per causal conv (2, C_in, kernel - 1)
    num_frames: int = 0  # frames covered, the prefix's included
    prefix: EstimatorCache | None = None

    @classmethod
    def on_prefix(cls, prefix: EstimatorCache) -> EstimatorCache:
        """An empty per-request cache continuing a shared prefix (which must not itself have one)."""
        if prefix.prefix is not None:
            raise ValueError("a shared prefix cache cannot itself continue a prefix")
        return cls([], [], list(prefix.tails), prefix.num_frames, prefix)

    def nbytes(self) -> int:
        """This cache's own bytes (a shared prefix is not counted)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, *self.tails))

