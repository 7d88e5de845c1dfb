"""Qwen2 decoder body in plain torch, with Hugging Face parameter names (`embed_tokens`, `layers.N.*`, `norm`).

Pre-norm blocks: RMSNorm -> GQA self-attention (rotary positions, bias on q/k/v, none on o_proj) -> residual,
RMSNorm -> SiLU-gated MLP -> residual; a final RMSNorm. Attention runs through torch SDPA. The LLM engine
(`vocalis.engine.model_runner`) runs the same layer maths over its paged KV cache: it calls the rotary
(`rotary_tables`, `apply_rotary`) and the residual structure (`Qwen2DecoderLayer.residual`) from here.

Two entry points:
- `Qwen2Model.forward(inputs_embeds, attention_mask)`: one causal pass over a (right-)padded batch (training,
  uncached scoring);
- `Qwen2Model.forward_cached(inputs_embeds, cache)`: incremental decoding. The `KVCache` is passed in and a new
  one is returned; the module never holds per-request state.

Qwen's own lm_head (the 151936-way text vocabulary) is deliberately absent: CosyVoice only reads hidden states.

Legend: B batch, T new positions, S cached + new positions, D hidden, H query heads, Hkv key/value heads,
Dh head width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vocalis.config import QwenConfig


@dataclass(frozen=True, slots=True)
class KVCache:
    """Keys and values of every layer for one decoding run; owned by the caller, replaced (not mutated) per step.

    `keys[i]`, `values[i]`: (B, Hkv, S, Dh) for layer i, post-rotary keys. An empty cache has no layers.
    """

    keys: tuple[torch.Tensor, ...] = ()
    values: tuple[torch.Tensor, ...] = ()

    @property
    def seq_len(self) -> int:
        """Number of positions already cached (the position id of the next input)."""
        return int(self.keys[0].shape[2]) if self.keys else 0


class Qwen2RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (as HF Qwen2), then scaled by `weight` in the input dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (T, Dh) for integer `positions` (T,), half-split layout (first half pairs with second).

    Computed per call instead of cached in a buffer, so the module has no non-checkpoint state and can be built
    on the meta device.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)  # (Dh/2,)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, Dh/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, Dh)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotary_tables(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin (T, Dh) for `apply_rotary`: the first half of sin negated."""
    cos, sin = rotary_cos_sin(positions, head_dim, theta, dtype)
    half = head_dim // 2
    return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Half-split rotary: x (..., Dh) with cos / sin_signed (`rotary_tables`) broadcast to it. The usual
    cat(-x2, x1) * sin, written as cat(x2, x1) * sin_signed (the same products, bit for bit), one op fewer."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin_signed


def module_norm(norm: Qwen2RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return norm(x)


class Qwen2Attention(nn.Module):
    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x: (B, T, D) -> (B, T, D) and this layer's keys/values (B, Hkv, S, Dh) including `past`; cos / sin:
        (T, Dh) from `rotary_tables`."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, Dh)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, Dh)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if past is not None:
            k = torch.cat((past[0], k), dim=2)  # (B, Hkv, S, Dh)
            v = torch.cat((past[1], v), dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=self.num_heads != self.num_kv_heads
        )  # (B, H, T, Dh)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)  # (B, T, H*Dh)
        return self.o_proj(out), (k, v)


class Qwen2MLP(nn.Module):
    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(config)
        self.mlp = Qwen2MLP(config)
        self.input_layernorm = Qwen2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Qwen2RMSNorm(config.hidden_size, config.rms_norm_eps)
        # dropout on the attention and MLP outputs before each residual add, in training mode only: a training
        # choice, not part of the architecture (the released Qwen2 has none); see Qwen2Model.set_residual_dropout
        self.residual_dropout = 0.0

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x: (B, T, D) -> (B, T, D) and the layer's keys/values."""
        kvs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def attend(h: torch.Tensor) -> torch.Tensor:
            out, kv = self.self_attn(h, cos, sin, attn_mask, is_causal, past)
            kvs.append(kv)
            return out

        return self.residual(x, attend, self.mlp, module_norm), kvs[0]

    def residual(self, x: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor],
                 mlp: Callable[[torch.Tensor], torch.Tensor],
                 norm: Callable[[Qwen2RMSNorm, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The layer's pre-norm residual structure over hidden states x (..., D): x + attend(norm(x)), then
        + mlp(norm(x)), each norm this layer's; dropout on both outputs in training mode. Callers give the
        attention (theirs holds the keys/values), the MLP and the norm as they compute them."""
        p = self.residual_dropout if self.training else 0.0
        attn = attend(norm(self.input_layernorm, x))
        x = x + (F.dropout(attn, p, True) if p > 0 else attn)
        out = mlp(norm(self.post_attention_layernorm, x))
        return x + (F.dropout(out, p, True) if p > 0 else out)


class Qwen2Model(nn.Module):
    """The Qwen2 decoder body (HF `Qwen2Model`): token table, decoder layers, final norm. No lm_head."""

    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def set_residual_dropout(self, p: float) -> None:
        """Dropout rate on every layer's attention and MLP outputs in training mode (0: none, as released)."""
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {p}")
        for layer in self.layers:
            layer.residual_dropout = p

    def forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal pass over a batch. inputs_embeds: (B, T, D); attention_mask: (B, T) bool/int, true/1 = real
        position (right padding), None = all real. Returns the final-norm hidden states (B, T, D); positions
        start at 0 in every row, and outputs at padded positions are meaningless.
        """
        t = inputs_embeds.shape[1]
        positions = torch.arange(t, device=inputs_embeds.device)
        if attention_mask is None:
            mask, is_causal = None, t > 1
        else:
            mask, is_causal = _padded_causal_mask(attention_mask.bool()), False
        hidden, _ = self._run(inputs_embeds, positions, mask, is_causal, None)
        return hidden

    def forward_cached(
        self, inputs_embeds: torch.Tensor, cache: KVCache | None
    ) -> tuple[torch.Tensor, KVCache]:
        """Incremental pass: inputs_embeds (B, T, D) continue the sequence held by `cache` (None = empty), all
        rows the same length. Returns hidden states (B, T, D) and a new cache covering S = cached + T positions.
        """
        t = inputs_embeds.shape[1]
        past_len = cache.seq_len if cache is not None else 0
        device = inputs_embeds.device
        positions = torch.arange(past_len, past_len + t, device=device)
        mask: torch.Tensor | None = None
        is_causal = False
        if t > 1 and past_len == 0:
            is_causal = True
        elif t > 1:
            # Query i sits at absolute position past_len + i and sees every key up to it.
            keys = torch.arange(past_len + t, device=device)
            mask = keys[None, :] <= positions[:, None]  # (T, S)
        pasts = list(zip(cache.keys, cache.values)) if cache is not None and cache.keys else None
        hidden, kvs = self._run(inputs_embeds, positions, mask, is_causal, pasts)
        return hidden, KVCache(tuple(k for k, _ in kvs), tuple(v for _, v in kvs))

    def _run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        pasts: list[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        cos, sin = rotary_tables(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        kvs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, cos, sin, mask, is_causal, pasts[i] if pasts is not None else None)
            kvs.append(kv)
        return self.norm(x), kvs


def _padded_causal_mask(valid: torch.Tensor) -> torch.Tensor:
    """valid: (B, T) -> boolean SDPA mask (B, 1, T, T): causal and only real keys. Each query may also see
    itself, so a row made only of padding never becomes all-masked (which SDPA turns into NaN)."""
    t = valid.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=valid.device).tril()  # (T, T)
    mask = causal[None] & valid[:, None, :]  # (B, T, T)
    mask = mask | torch.eye(t, dtype=torch.bool, device=valid.device)[None]
    return mask[:, None]  # (B, 1, T, T)
