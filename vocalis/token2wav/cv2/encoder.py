"""Chunk-incremental forward of the flow's `UpsampleConformerEncoder` (streaming masks), batched over requests.

With block-causal attention (blocks of `static_chunk_size` tokens counted from position 0) a position's output
never changes once its block is complete and the look-ahead tokens after it are known. So a streaming request
encodes only its new tokens [a, b) per chunk, `a` on a block boundary:
- the look-ahead conv pair reads tokens a-2 .. b+2, re-embedded from the ids (cheap, so nothing is cached);
- each conformer layer reads the keys/values of [0, a) from the request's `EncoderCache`;
- the causal x2 upsampling conv reads the conformer output of tokens a-2, a-1 (`EncoderCache.tail`).
The result equals the module's streaming forward over [0, b) restricted to [a, b) (up to float summation
order); `tests/test_engine_token2wav.py` checks it. Relative positions enter as `linear_pos(table)`, which
depends only on the weights, so `RelPosProjections` computes it once per layer and every request shares it.

Rows of a batch have their own [a, b); the new positions are right-padded to the longest. Every operation
except attention is position-wise or causal, so padding never reaches a valid position, and attention runs
per request over its own keys.

Legend: R requests, n new positions (padded), D width, H heads, Dh head width, L table half-length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vocalis.models.flow.encoder import ConformerEncoderLayer, relative_positional_table
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec

# Upsample1D pads 2*stride upsampled frames on the left: the output of 2 tokens before the chunk.
_UP_TAIL_TOKENS = 2
# The look-ahead conv pair reads 2 conv1 outputs to the left (conv2 has kernel 3).
_LEFT_TOKENS = 2


@dataclass
class EncoderCache:
    """One request's encoder state after `num_tokens` positions (a multiple of the attention block)."""

    keys: list[torch.Tensor] = field(default_factory=list)  # per layer (encoders, then up_encoders): (H, T, Dh)
    values: list[torch.Tensor] = field(default_factory=list)
    tail: torch.Tensor | None = None  # (2, D) conformer output of the two tokens before num_tokens
    num_tokens: int = 0  # positions covered, the prefix's included
    # A voice's shared prompt prefix (read only); then keys/values hold only positions [prefix.num_tokens, ...).
    prefix: EncoderCache | None = None

    @classmethod
    def on_prefix(cls, prefix: EncoderCache) -> EncoderCache:
        """An empty per-request cache continuing a shared prefix (which must not itself have one)."""
        if prefix.prefix is not None:
            raise ValueError("a shared prefix cache cannot itself continue a prefix")
        return cls([], [], prefix.tail, prefix.num_tokens, prefix)

    def nbytes(self) -> int:
        """This cache's own bytes (a shared prefix is not counted)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass
class EncoderRow:
    """One request's share of a chunk: positions [start, end) of `ids` (prompt + generated ids, (T,) int).

    final: no look-ahead tokens follow `end` (zeros, as the module's finalize path); otherwise ids[end:end+3]
    must exist. keep: append this chunk to `cache` (False for a request's last chunk).
    """

    ids: torch.Tensor
    start: int
    end: int
    final: bool
    cache: EncoderCache
    keep: bool = True


class RelPosProjections:
    """`linear_pos(relative table)` per conformer layer, (2L-1, H, Dh), row m = relative position L-1-m."""

    def __init__(self, layers: list[ConformerEncoderLayer]) -> None:
        self.layers = layers
        # (L, tables): replaced whole when it grows, so threads stepping requests side by side read a matching pair
        self._tables: tuple[int, list[torch.Tensor]] = (0, [])

    def get(self, index: int, length: int) -> tuple[torch.Tensor, int]:
        """Projected table of layer `index` covering relative positions |i - j| < length, and its L."""
        size, tables = self._tables
        if length > size:
            size = max(length, 2 * size, 256)
            tables = []
            for layer in self.layers:
                attn = layer.self_attn
                w = attn.linear_pos.weight
                table = relative_positional_table(size, w.shape[1], w.device, torch.float32)
                table = table.to(w.dtype) if w.is_floating_point() else table
                tables.append(attn.linear_pos(table)[0].view(-1, attn.h, attn.d_k))  # (2L-1, H, Dh)
            self._tables = (size, tables)
        return tables[index], size


class EncoderStreamer:
    """Incremental encoder for one flow module; holds only weight-derived tables shared by all requests."""

    def __init__(self, flow: CausalMaskedDiffWithXvec) -> None:
        self.flow = flow
        enc = flow.encoder
        self.chunk = enc.config.static_chunk_size
        self.stride = enc.config.up_stride
        self.lookahead = enc.config.pre_lookahead_len
        self.pos = RelPosProjections(list(enc.encoders))
        self.up_pos = RelPosProjections(list(enc.up_encoders))

    def new_cache(self) -> EncoderCache:
        return EncoderCache()

    def _embed_window(self, rows: list[EncoderRow], n: int) -> torch.Tensor:
        """Embedded tokens start-2 .. start+n+lookahead per row, (R, n + 2 + lookahead, D); zeros where the
        module would see zero padding (after a final row's end, padding of short rows)."""
        dev = self.flow.input_embedding.weight.device
        width = n + _LEFT_TOKENS + self.lookahead
        ids = torch.zeros(len(rows), width, dtype=torch.long, device=dev)
        keep = torch.zeros(len(rows), width, 1, dtype=torch.bool, device=dev)
        for r, row in enumerate(rows):
            lo = max(row.start - _LEFT_TOKENS, 0)
            hi = row.end if row.final else row.end + self.lookahead
            if hi > row.ids.numel():
                raise ValueError(f"encoder row needs ids up to {hi}, has {row.ids.numel()}")
            off = lo - (row.start - _LEFT_TOKENS)
            ids[r, off : off + hi - lo] = row.ids[lo:hi].to(dev).long().clamp(min=0)
            keep[r, off : off + hi - lo] = True
        x = self.flow.input_embedding(ids)  # (R, W, D_in)
        x, _ = self.flow.encoder.embed(x)  # (R, W, D) scaled; the rel-pos table is not used here
        return x * keep.to(x.dtype)

    def _lookahead(self, rows: list[EncoderRow], window: torch.Tensor) -> torch.Tensor:
        """PreLookaheadLayer on the new positions: window (R, W, D) -> (R, n, D)."""
        layer = self.flow.encoder.pre_lookahead_layer
        h = window.transpose(1, 2)  # (R, D, W)
        h = F.leaky_relu(F.conv1d(h, layer.conv1.weight, layer.conv1.bias))  # (R, D, n + 2): positions start-2 ..
        for r, row in enumerate(rows):
            if row.start == 0:  # the module pads conv2's input with zeros, not with conv1 of missing tokens
                h[r, :, :_LEFT_TOKENS] = 0
        h = F.conv1d(h, layer.conv2.weight, layer.conv2.bias)  # (R, D, n)
        return h.transpose(1, 2) + window[:, _LEFT_TOKENS : _LEFT_TOKENS + h.shape[2]]

    def _layer(
        self,
        layer: ConformerEncoderLayer,
        x: torch.Tensor,
        rows: list[EncoderRow],
        starts: list[int],
        lens: list[int],
        cache_index: int,
        table: torch.Tensor,
        table_len: int,
        chunk: int,
    ) -> torch.Tensor:
        """One conformer layer over new positions x (R, n, D) with cached keys -> (R, n, D)."""
        attn = layer.self_attn
        r_, n, _ = x.shape
        h = layer.norm_mha(x)
        q = attn.linear_q(h).view(r_, n, attn.h, attn.d_k)  # (R, n, H, Dh)
        k = attn.linear_k(h).view(r_, n, attn.h, attn.d_k).transpose(1, 2)  # (R, H, n, Dh)
        v = attn.linear_v(h).view(r_, n, attn.h, attn.d_k).transpose(1, 2)
        out = torch.zeros(r_, n, attn.h * attn.d_k, dtype=v.dtype, device=x.device)
        for r, row in enumerate(rows):
            a, m = starts[r], lens[r]
            b = a + m
            cache = row.cache
            shared = cache.prefix
            head_k = [shared.keys[cache_index].to(k.dtype)] if shared is not None else []
            head_v = [shared.values[cache_index].to(v.dtype)] if shared is not None else []
            keys = torch.cat([*head_k, cache.keys[cache_index].to(k.dtype), k[r, :, :m]], dim=1)  # (H, b, Dh)
            values = torch.cat([*head_v, cache.values[cache_index].to(v.dtype), v[r, :, :m]], dim=1)
            qr = q[r, :m]  # (m, H, Dh)
            content = torch.matmul((qr + attn.pos_bias_u).transpose(0, 1), keys.transpose(-2, -1))  # (H, m, b)
            # rows of the relative positions b-1 down to a-b+1 (row = L-1-rel); then pick rel = i - j
            p = table[table_len - b : table_len + b - a - 1].to(qr.dtype)  # (2b-a-1, H, Dh)
            position = torch.matmul((qr + attn.pos_bias_v).transpose(0, 1), p.permute(1, 2, 0))  # (H, m, 2b-a-1)
            qi = torch.arange(m, device=x.device)
            kj = torch.arange(b, device=x.device)
            index = (b - 1 - a) - qi[:, None] + kj[None, :]  # (m, b)
            position = torch.gather(position, -1, index.expand(attn.h, m, b))
            scores = (content + position) / math.sqrt(attn.d_k)
            limit = ((a + qi) // chunk + 1) * chunk
            blocked = kj[None, :] >= limit[:, None]  # (m, b)
            scores = scores.masked_fill(blocked, -float("inf"))
            weights = torch.softmax(scores, dim=-1).masked_fill(blocked, 0.0)
            out[r, :m] = torch.matmul(weights.to(values.dtype), values).transpose(0, 1).reshape(m, -1)
            if row.keep and shared is None:
                cache.keys[cache_index], cache.values[cache_index] = keys, values
            elif row.keep:  # own positions only
                cache.keys[cache_index] = torch.cat([cache.keys[cache_index], k[r, :, :m]], dim=1)
                cache.values[cache_index] = torch.cat([cache.values[cache_index], v[r, :, :m]], dim=1)
        x = x + attn.linear_out(out)
        return x + layer.feed_forward(layer.norm_ff(x))

    def forward(self, rows: list[EncoderRow]) -> tuple[torch.Tensor, list[int]]:
        """New positions of every row -> mu (R, stride * n, 80) and each row's valid frame count.

        Each row's cache must hold exactly `start` positions; with `keep` it then holds `end`.
        """
        enc = self.flow.encoder
        lens = [row.end - row.start for row in rows]
        starts = [row.start for row in rows]
        for row in rows:
            if row.cache.num_tokens != row.start:
                raise ValueError(f"encoder cache holds {row.cache.num_tokens} positions, "
                                 f"the chunk starts at {row.start}")
            if row.start % self.chunk:
                raise ValueError(f"a chunk must start on a {self.chunk}-token block boundary, got {row.start}")
            if row.keep and row.end % self.chunk:
                raise ValueError(f"a cached chunk must end on a {self.chunk}-token block boundary, got {row.end}")
            if not row.cache.keys:
                self._init_cache(row.cache)
        n = max(lens)
        x = self._lookahead(rows, self._embed_window(rows, n))  # (R, n, D)
        longest = max(starts) + n
        for i, layer in enumerate(enc.encoders):
            table, table_len = self.pos.get(i, longest)
            x = self._layer(layer, x, rows, starts, lens, i, table, table_len, self.chunk)

        # Causal x2 upsampling: prepend the two previous tokens' rows, repeat, conv without padding.
        tails = torch.stack([row.cache.tail.to(x.dtype) for row in rows])  # (R, 2, D)
        up_in = torch.cat([tails, x], dim=1)  # (R, n + 2, D)
        for r, row in enumerate(rows):
            if row.keep:
                row.cache.tail = up_in[r, lens[r] : lens[r] + _UP_TAIL_TOKENS].clone()
        h = torch.repeat_interleave(up_in.transpose(1, 2), self.stride, dim=2)  # (R, D, stride*(n+2))
        conv = enc.up_layer.conv
        x = F.conv1d(h, conv.weight, conv.bias).transpose(1, 2)  # (R, stride*n, D)
        x, _ = enc.up_embed(x)
        up_starts = [s * self.stride for s in starts]
        up_lens = [m * self.stride for m in lens]
        base = len(enc.encoders)
        for i, layer in enumerate(enc.up_encoders):
            table, table_len = self.up_pos.get(i, longest * self.stride)
            x = self._layer(layer, x, rows, up_starts, up_lens, base + i, table, table_len, self.chunk * self.stride)
        for row in rows:
            if row.keep:
                row.cache.num_tokens = row.end
        return self.flow.encoder_proj(enc.after_norm(x)), up_lens  # (R, stride*n, 80)

    def _init_cache(self, cache: EncoderCache) -> None:
        enc = self.flow.encoder
        w = self.flow.encoder_proj.weight
        dtype = w.dtype if w.is_floating_point() else torch.float32
        for layer in (*enc.encoders, *enc.up_encoders):
            attn = layer.self_attn
            empty = torch.zeros(attn.h, 0, attn.d_k, dtype=dtype, device=w.device)
            cache.keys.append(empty)
            cache.values.append(empty)
        if cache.tail is None:  # a cache continuing a prefix starts with the prefix's tail
            cache.tail = torch.zeros(_UP_TAIL_TOKENS, enc.output_size, dtype=dtype, device=w.device)
