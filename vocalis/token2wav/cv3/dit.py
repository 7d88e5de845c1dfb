"""The CosyVoice 3 DiT over a streaming call's new frames only, continuing what earlier calls left (`DiTCache`).

Why this is exact: a non-final streaming call ends on a whole attention block, and with block-causal attention
the blocks an earlier call computed come out the same in a later one; the DiT's other inputs agree there too (the
start noise is fixed by absolute frame, mu of a token looks at most 3 tokens to its right, which a non-final call
has, and the position convs are causal). So a call need only run its new blocks: their rotary positions start at
the frames already computed, each attention layer reads the keys/values earlier calls left for that Euler step
and guidance row, and the two k-wide position convs read the last k - 1 frames of their inputs. Only new frames
go through the Euler steps. The official final call runs with full attention (every frame changes), so it is a
full pass; a block-causal final call (`final_attention="causal"`) runs here too, over its new frames, keeping
nothing (its last block may be partial).

One `DiTCache` per request per Euler step. Memory per cached frame: depth x (K + V) x 2 guidance rows x the
attention width, e.g. 22 x 2 x 2 x 1024 = 90 k values per Euler step at the released shapes (x 10 steps, ~3.6 MB
in fp32, half in bf16).

Legend: R requests, n new frames of a row (n_max the longest), c cached frames, D model width, E = H x Dh,
C = 80 mel channels, K the position-conv kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vocalis.models.cv3.dit import DiT, _modulate, apply_rotary


@dataclass
class DiTCache:
    """One request at one Euler step: rotated keys and values per block, the position convs' input tails.

    Tensors hold both guidance rows (conditional first); they are replaced, never written in place, so a prefix is
    shared by every request of its voice."""

    keys: list[torch.Tensor] = field(default_factory=list)  # per block (2, c, E), rotary applied
    values: list[torch.Tensor] = field(default_factory=list)  # per block (2, c, E)
    proj_tail: torch.Tensor | None = None  # (2, K - 1, D) the input projection's last frames
    conv_tail: torch.Tensor | None = None  # (2, K - 1, D) the first position conv's (after Mish) last frames
    num_frames: int = 0  # frames computed: the prefix's and these keys'
    prefix: DiTCache | None = None  # the voice's shared prompt prefix, read in place: keys hold the frames after it

    @classmethod
    def continuing(cls, prefix: DiTCache) -> DiTCache:
        """A request's cache starting from a voice's prefix (shared, never written)."""
        return cls(proj_tail=prefix.proj_tail, conv_tail=prefix.conv_tail, num_frames=prefix.num_frames,
                   prefix=prefix)

    def nbytes(self) -> int:
        """This cache's own tensors (a shared prefix is counted once, by its owner)."""
        tensors = [*self.keys, *self.values, *(t for t in (self.proj_tail, self.conv_tail) if t is not None)]
        return sum(t.numel() * t.element_size() for t in tensors)


def cache_bytes_per_frame(dit: DiT, dtype: torch.dtype) -> int:
    """Bytes one cached frame adds at one Euler step (keys and values of every block, both guidance rows)."""
    c = dit.config
    return c.depth * 2 * 2 * c.heads * c.dim_head * torch.empty(0, dtype=dtype).element_size()


def cache_bytes_per_stream(dit: DiT) -> int:
    """Bytes a request's cache holds at one Euler step whatever its length: both position convs' fp32 tails."""
    c = dit.config
    return 2 * 2 * (c.conv_pos_kernel - 1) * c.dim * 4


def _tails(caches: list[DiTCache], which: str, frames: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """(2R, K - 1, D) left context (zeros before a request's first frame), rows [conditional; unconditional]."""
    parts = [getattr(c, which) for c in caches]
    zero = like.new_zeros(2, frames, width)
    stacked = torch.stack([zero if p is None else p.to(like.dtype) for p in parts])  # (R, 2, K - 1, D)
    return torch.cat([stacked[:, 0], stacked[:, 1]])


def _position_conv(conv: torch.nn.Sequential, left: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Causal k-wide grouped conv + Mish over [left context, h]: (2R, K - 1, D), (2R, n, D) -> (2R, n, D)."""
    seq = torch.cat([left, h], dim=1).transpose(1, 2)  # (2R, D, K - 1 + n)
    return conv(seq).transpose(1, 2)


def dit_new_frames(
    dit: DiT,
    x: torch.Tensor,
    mu: torch.Tensor,
    cond: torch.Tensor,
    spks: torch.Tensor,
    t: torch.Tensor,
    lens: list[int],
    caches: list[DiTCache],
    keep: list[bool],
    cache_dtype: torch.dtype | None,
) -> torch.Tensor:
    """Velocity of every row's new frames. x, mu, cond (2R, n_max, C) rows [0, R) conditional, [R, 2R)
    unconditional; spks (2R, C_spk); t scalar; lens[i] new frames of request i (whole blocks unless it is a final
    call, starting at caches[i].num_frames); caches: request i's cache at this Euler step, extended when keep[i]
    -> (2R, n_max, C)."""
    cfg = dit.config
    r2, n_max, _ = x.shape
    r = r2 // 2
    width = cfg.conv_pos_kernel - 1
    silu_t = F.silu(dit.time_embed(t.reshape(1).expand(r2).to(x.dtype)))  # (2R, D)
    spk = spks.unsqueeze(1).expand(-1, n_max, -1)
    h = dit.input_embed.proj(torch.cat((x, cond, mu, spk), dim=-1))  # (2R, n_max, D)
    pos = dit.input_embed.conv_pos_embed
    left1 = _tails(caches, "proj_tail", width, cfg.dim, h)
    m1 = _position_conv(pos.conv1, left1, h)
    left2 = _tails(caches, "conv_tail", width, cfg.dim, h)
    new_tails = []
    for i, n in enumerate(lens):  # the last K - 1 frames of each row's [tail, new] inputs of both convs
        rows = [i, r + i]
        proj = torch.cat([left1[rows], h[rows, :n]], dim=1)[:, n:]
        conv = torch.cat([left2[rows], m1[rows, :n]], dim=1)[:, n:]
        new_tails.append((proj, conv))
    h = _position_conv(pos.conv2, left2, m1) + h
    starts = torch.tensor([c.num_frames for c in caches] * 2, device=x.device)
    positions = (starts[:, None] + torch.arange(n_max, device=x.device)[None]).float()  # (2R, n_max)
    inv_freq = dit.rotary_embed.inv_freq.float()
    angles = (positions[..., None] * inv_freq).repeat_interleave(2, dim=-1)  # (2R, n_max, Dh)
    valid = torch.zeros(r2, n_max, 1, dtype=x.dtype, device=x.device)
    for i, n in enumerate(lens):
        valid[[i, r + i], :n] = 1
    masks = [_new_block_mask(c.num_frames, n, cfg.static_chunk_size, x.device) for c, n in zip(caches, lens)]
    for layer, block in enumerate(dit.transformer_blocks):
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = block.attn_norm.linear(silu_t).chunk(6, dim=1)
        a_in = _modulate(h, shift_a, scale_a)
        att = block.attn
        q = apply_rotary(att.to_q(a_in), angles)  # (2R, n_max, E)
        k = apply_rotary(att.to_k(a_in), angles)
        v = att.to_v(a_in)
        out = torch.zeros_like(q)
        for i, (c, n) in enumerate(zip(caches, lens)):
            rows = [i, r + i]
            own_k, own_v = k[rows, :n], v[rows, :n]  # (2, n, E)
            if len(c.keys) > layer:  # frames this request computed before (after its prefix, if any)
                own_k = torch.cat([c.keys[layer].to(q.dtype), own_k], dim=1)
                own_v = torch.cat([c.values[layer].to(q.dtype), own_v], dim=1)
            k_all, v_all = own_k, own_v
            if c.prefix is not None:  # read where it lies; only this call's attention input holds a copy
                k_all = torch.cat([c.prefix.keys[layer].to(q.dtype), own_k], dim=1)  # (2, c + n, E)
                v_all = torch.cat([c.prefix.values[layer].to(q.dtype), own_v], dim=1)
            heads = (q[rows, :n], k_all, v_all)
            qh, kh, vh = (y.unflatten(-1, (att.heads, -1)).transpose(1, 2) for y in heads)  # (2, H, T, Dh)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=masks[i])  # (2, H, n, Dh)
            out[rows, :n] = o.transpose(1, 2).flatten(-2)
            if keep[i]:
                store = cache_dtype or own_k.dtype
                if len(c.keys) > layer:
                    c.keys[layer], c.values[layer] = own_k.to(store), own_v.to(store)
                else:  # its first frames: the layers come in order
                    c.keys.append(own_k.to(store))
                    c.values.append(own_v.to(store))
        attn = att.to_out[0](out) * valid
        h = h + gate_a[:, None] * attn
        h = h + gate_f[:, None] * block.ff(_modulate(h, shift_f, scale_f))
    for i, (c, n) in enumerate(zip(caches, lens)):
        if keep[i]:
            c.proj_tail, c.conv_tail = new_tails[i]
            c.num_frames += n
    scale, shift = dit.norm_out.linear(silu_t).chunk(2, dim=1)
    return dit.proj_out(_modulate(h, shift, scale))  # (2R, n_max, C)


def _new_block_mask(cached: int, n: int, chunk: int, device: torch.device) -> torch.Tensor:
    """(n, cached + n) bool: every cached frame, and new frames block-causally (blocks of `chunk` from frame 0)."""
    q_block = (cached + torch.arange(n, device=device)) // chunk
    k_block = torch.arange(cached + n, device=device) // chunk
    return k_block[None, :] <= q_block[:, None]
