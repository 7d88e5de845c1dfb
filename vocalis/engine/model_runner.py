"""Tensors, no policy: the paged KV cache and one forward pass over a scheduled batch of the speech LM.

The K/V of every layer live in two preallocated tensors (L, slots, Hkv, Dh), slot = block * block_size +
offset; a step writes only its new positions (index_copy_) and never copies the cache. Attention is plain
torch so it runs anywhere: rows with one query (decodes, one-position prefill chunks) are batched, each
gathering its live context by block table (B, Lmax) with padded slots masked; multi-position prefill chunks
attend, one request at a time, to their cached prefix plus themselves with a causal mask. Grouped-query
attention reshapes queries into their key/value groups instead of repeating keys.

The weights are the speech LM's own modules (`Qwen2LM` or `CosyVoice3LM`; what differs is in `lm_family`), called
as modules (so a precision backend may swap a Linear for a quantised one) through the model's own layer maths
(`models.qwen2`: rotary, residual structure); Qwen's 151,936-way lm_head is never computed, only `llm_decoder` on
rows that sample.
Everything is plain device-agnostic torch, so it runs on CUDA as is (no flash/paged CUDA kernel); on CUDA,
decode steps replay captured graphs (`decode_graphs`), which write their padding rows to one scratch slot past
the last block.

Legend: N scheduled positions, B single-query rows, L layers, Lmax longest context, n/c a prefill chunk's
new positions / context, H query heads, Hkv key/value heads, G = H / Hkv, Dh head width, D hidden, V speech ids.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from vocalis.adapters.batched import AdapterBank
from vocalis.adapters.packed import LayerLora, PackedLora, StepLora
from vocalis.engine.config import FUSED_DECODE_KINDS
from vocalis.engine.decode_graphs import DecodeGraphs
from vocalis.engine.decode_stack import decode_stack
from vocalis.engine.id_space import IdSpace
from vocalis.engine.lm_family import SpeechLM, family_of
from vocalis.engine.packed_weights import PackedLayer, gemm
from vocalis.engine.request import Request
from vocalis.kernels.huge_pages import to_huge_pages
from vocalis.models.qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, apply_rotary, rotary_tables
from vocalis.precision.int8_linear import Int8Linear

log = logging.getLogger(__name__)


def embed_engine_ids(llm: SpeechLM, space: IdSpace, ids: torch.Tensor, all_speech: bool = False) -> torch.Tensor:
    """Engine ids (N,) -> (N, D) in the speech table's dtype, each from the table it belongs to (`IdSpace`): row
    for row what the LM's `prefill_embeddings` builds. all_speech: every id is a speech id (one lookup)."""
    family = family_of(llm)
    assert family.ids == space, "an id space of another model"
    return family.embed(llm, ids, all_speech)


def kv_bytes_per_block(llm: SpeechLM, block_size: int) -> int:
    q = llm.config.qwen
    itemsize = llm.speech_embedding.weight.element_size()
    return 2 * q.num_hidden_layers * block_size * q.num_key_value_heads * q.head_dim * itemsize


@dataclass(slots=True)
class _Prefill:
    """One multi-position chunk: token rows [start, start + n) of the batch; its context slots (c,)."""

    start: int
    n: int
    computed: int
    slots: torch.Tensor


@dataclass(slots=True)
class StepInputs:
    ids: torch.Tensor  # (N,) engine ids
    positions: torch.Tensor  # (N,)
    write_slots: torch.Tensor  # (N,) where each position's K/V goes
    num_single: int  # the first B rows are single-query rows
    gather_slots: torch.Tensor | None  # (B, Lmax) context slots of single-query rows (padding repeats slot 0)
    valid: torch.Tensor | None  # (B, Lmax) real context positions
    context_lens: torch.Tensor | None  # (B,) real context length of each single-query row (incl. itself)
    prefills: list[_Prefill]
    sample_rows: torch.Tensor  # (R,) rows whose output is sampled, in scheduled order
    all_speech: bool
    # (N,) each position's LoRA adapter (-1: none); None: no position of the step has one (or there is no bank)
    adapter_rows: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, llm: SpeechLM, num_blocks: int, block_size: int, max_positions: int,
                 packed: Sequence[PackedLayer | None] | None = None, cuda_graphs: bool = True,
                 fused_decode: Collection[str] = FUSED_DECODE_KINDS, huge_pages: bool = True,
                 reserve_kv: bool = False, adapter_bank: AdapterBank | None = None) -> None:
        """packed: fused weights per layer (`packed_weights.pack_llm`); None or a None entry: call the modules.
        cuda_graphs: replay decode steps as CUDA graphs when the model is on a CUDA device.
        fused_decode: the weight kinds whose few-row decode steps may run as one native call (`decode_stack`).
        huge_pages: move the decoder's weights and the KV cache onto huge pages (`kernels.huge_pages`).
        reserve_kv: write the whole KV cache once now, so that all of it is resident from the start
        (`EngineConfig.reserve_kv_cache`).
        adapter_bank: the LoRA bank whose `BankedLinear`s `llm` holds (`adapters.batched`): each request's adapter
        added to the packed GEMMs' outputs (`adapters.packed`); steps with no adapter row may still run fused."""
        q = llm.config.qwen
        self.llm = llm
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_positions = max_positions
        self.scratch_slot = num_blocks * block_size  # the first slot of one extra block no request owns
        self.family = family_of(llm)  # id space and embedding of this LM family
        self.ids = self.family.ids
        self.device = llm.speech_embedding.weight.device
        self.dtype = llm.speech_embedding.weight.dtype
        self.num_heads, self.num_kv_heads, self.head_dim = q.num_attention_heads, q.num_key_value_heads, q.head_dim
        self.packed = list(packed) if packed is not None else [None] * q.num_hidden_layers
        self.adapter_bank = adapter_bank
        # the bank's updates fused as the packed layers' weights are (the unpacked layers' modules add their own)
        self.packed_lora = None
        if adapter_bank is not None and any(pk is not None for pk in self.packed):
            self.packed_lora = PackedLora(adapter_bank, llm, llm.qwen.layers, self.dtype)
        shape = (q.num_hidden_layers, (num_blocks + 1) * block_size, q.num_key_value_heads, q.head_dim)
        # [empty] never-written slots are only ever read as masked padding, which repeats a written slot
        self.k_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        for cache in (self.k_cache, self.v_cache):  # the scratch block: finite values for padding rows to read
            cache[:, self.scratch_slot:].zero_()
        self._offsets = torch.arange(block_size, device=self.device)
        # rotary tables for every position, from the same function as the dense path (identical values)
        self._cos, self._sin_signed = rotary_tables(torch.arange(max_positions, device=self.device), q.head_dim,
                                                    q.rope_theta, self.dtype)  # (max_positions, Dh)
        # int8, fp32 or bf16 decode steps of a few rows: the whole layer stack in one native call, else None
        self.fused_decode = decode_stack(llm, self.packed, self.dtype, fused_decode)
        self.graphs = DecodeGraphs(self) if cuda_graphs and self.device.type == "cuda" else None
        on_huge = to_huge_pages(self._long_lived_tensors()) if huge_pages else 0
        if on_huge:
            log.info("decoder weights and KV cache: %.0f MiB on huge pages", on_huge / 2**20)
        if reserve_kv:  # after the huge-page advice, so that the pages fault in huge
            for cache in (self.k_cache, self.v_cache):
                cache.zero_()
        log.info("KV cache: %d blocks x %d positions (%.1f MiB)", num_blocks, block_size,
                 2 * self.k_cache.numel() * self.k_cache.element_size() / 2**20)

    def _long_lived_tensors(self) -> Iterator[torch.Tensor]:
        """What a decode step streams whole: the decoder layers' and the speech head's weights (with the int8
        kernel's packed ones) and the KV cache. Not the embedding tables (a step reads one row of them; Qwen's text
        table alone is ~0.5 GB at the 0.5B shapes, a cost to collapse at start-up for nothing)."""
        decoder = (self.llm.qwen.layers, self.llm.qwen.norm, self.llm.llm_decoder)
        for part in decoder:
            yield from part.parameters()
            yield from part.buffers()
        for m in (m for part in decoder for m in part.modules()):
            if isinstance(m, Int8Linear):
                values = (getattr(m.packed, f.name) for f in dataclasses.fields(m.packed))
                yield from (t for t in values if isinstance(t, torch.Tensor))
        yield self.k_cache
        yield self.v_cache

    # ---- inputs --------------------------------------------------------------------------------------
    def _slots(self, block_table: Sequence[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, scheduled: Sequence[tuple[Request, int]]) -> StepInputs:
        """Flatten a scheduled batch: single-query rows first, then prefill chunks."""
        single = [(r, n) for r, n in scheduled if n == 1]
        multi = [(r, n) for r, n in scheduled if n > 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        row_of: dict[int, int] = {}
        for r, _ in single:
            p = r.num_computed_tokens
            row_of[id(r)] = len(ids)
            ids.append(r.token_ids[p])
            positions.append(p)
            slots.extend(self._slots(r.block_table, p, p + 1))
        gather = valid = ctx = None
        dev = self.device
        if single:
            ctx = torch.tensor([r.num_computed_tokens + 1 for r, _ in single], device=dev)  # (B,)
            max_blocks = max(len(r.block_table) for r, _ in single)
            table = torch.tensor([r.block_table + [r.block_table[0]] * (max_blocks - len(r.block_table))
                                  for r, _ in single], device=dev)  # (B, max_blocks)
            all_slots = (table[:, :, None] * self.block_size + self._offsets).reshape(len(single), -1)
            lmax = int(max(r.num_computed_tokens + 1 for r, _ in single))
            all_slots = all_slots[:, :lmax]  # (B, Lmax)
            valid = torch.arange(lmax, device=dev)[None, :] < ctx[:, None]  # (B, Lmax)
            gather = torch.where(valid, all_slots, all_slots[:, :1])
        prefills: list[_Prefill] = []
        for r, n in multi:
            c0 = r.num_computed_tokens
            start = len(ids)
            ids.extend(r.token_ids[c0:c0 + n])
            positions.extend(range(c0, c0 + n))
            slots.extend(self._slots(r.block_table, c0, c0 + n))
            row_of[id(r)] = start + n - 1
            ctx_slots = torch.tensor(self._slots(r.block_table, 0, c0 + n), device=dev)
            prefills.append(_Prefill(start, n, c0, ctx_slots))
        adapters = [r.adapter_index for r, _ in single] + [r.adapter_index for r, n in multi for _ in range(n)]
        sample_rows = [row_of[id(r)] for r, n in scheduled
                       if r.sample_at_end and r.num_computed_tokens + n == r.num_tokens]  # as SchedulerOutput.sampled
        return StepInputs(
            ids=torch.tensor(ids, device=dev),
            positions=torch.tensor(positions, device=dev),
            write_slots=torch.tensor(slots, device=dev),
            num_single=len(single),
            gather_slots=gather,
            valid=valid,
            context_lens=ctx,
            prefills=prefills,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),
            all_speech=max(ids) < self.ids.num_speech,
            # decided here, on the host, so that a step with no adapter row may run fused with no sync
            adapter_rows=torch.tensor(adapters, device=dev) if max(adapters) >= 0 else None,
        )

    # ---- forward -------------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor, all_speech: bool) -> torch.Tensor:
        """Engine ids (N,) -> (N, D) from the table each id belongs to."""
        return self.family.embed(self.llm, ids, all_speech)

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[tuple[Request, int]]) -> torch.Tensor:
        """Compute the scheduled positions, write their K/V, return log-probs (R, V) of the sampled rows."""
        return self.forward(self.prepare(scheduled))

    @torch.inference_mode()
    def forward(self, inp: StepInputs) -> torch.Tensor:
        # [decode speed] a batch-1 decode step is ~170 weight GEMMs plus ~40 small ops per layer; at the 0.5B
        # shapes every small op costs a dispatch and may wake the thread pool, so the loop keeps them few:
        # fused RMSNorm (fp32 activations), one rotary pass over q and k together, SDPA for single-query rows
        lora = None
        if self.adapter_bank is not None:  # the banked Linear layers (the head, any unpacked layer) read it here
            self.adapter_bank.rows = inp.adapter_rows
            if inp.adapter_rows is not None and self.packed_lora is not None:
                lora = self.packed_lora.step(inp.adapter_rows)
        if self.graphs is not None and self.graphs.applies(inp):
            return self.graphs.forward(inp)
        x = self.embed(inp.ids, inp.all_speech)  # (N, D)
        cos = self._cos.index_select(0, inp.positions)[:, None, :]  # (N, 1, Dh)
        sin = self._sin_signed.index_select(0, inp.positions)[:, None, :]
        n_tok, dh = x.shape[0], self.head_dim
        fused = self.fused_decode
        if fused is not None and not inp.prefills and n_tok <= fused.max_rows and lora is None:
            # only single-query rows, none with an adapter: every layer in one native call (int8_decode)
            assert inp.gather_slots is not None and inp.context_lens is not None
            if fused.has_head:  # the final norm and the head too
                logits = fused.forward_logits(x, cos.view(n_tok, dh), sin.view(n_tok, dh), self.k_cache,
                                              self.v_cache, inp.write_slots, inp.gather_slots, inp.context_lens)
                return logits.index_select(0, inp.sample_rows).log_softmax(dim=-1)  # (R, V)
            x = fused.forward(x, cos.view(n_tok, dh), sin.view(n_tok, dh), self.k_cache, self.v_cache,
                              inp.write_slots, inp.gather_slots, inp.context_lens)
            return self._head(x, inp)
        return self._head(self._layers(x, cos, sin, inp, self._single_mask(inp), lora), inp)

    def static_decode(self, ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                      gather_slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """A decode step of fixed shapes (for `decode_graphs`): B single-query rows, each gathering Lmax context
        slots of which `valid` are real; ids (B,), positions (B,), write_slots (B,), gather_slots / valid
        (B, Lmax) -> logits (B, V) of every row. No host synchronisation, so it can be captured."""
        b = ids.shape[0]
        inp = StepInputs(ids=ids, positions=positions, write_slots=write_slots, num_single=b,
                         gather_slots=gather_slots, valid=valid, context_lens=None, prefills=[],
                         sample_rows=torch.arange(b, device=ids.device), all_speech=True)
        x = self.embed(ids, True)  # (B, D)
        cos = self._cos.index_select(0, positions)[:, None, :]  # (B, 1, Dh)
        sin = self._sin_signed.index_select(0, positions)[:, None, :]
        return self._logits(self._layers(x, cos, sin, inp, valid[:, None, None, :]))  # (B, V)

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inp: StepInputs,
                mask: torch.Tensor | None, lora: StepLora | None = None) -> torch.Tensor:
        """Hidden states (N, D) through every decoder layer (the model's residual structure, `Qwen2DecoderLayer`),
        writing each position's K/V. lora: the rows' adapter updates for the packed GEMMs."""
        for layer_idx, layer in enumerate(self.llm.qwen.layers):
            pk = self.packed[layer_idx]
            lo = None if lora is None else lora.layers[layer_idx]  # None: no adapter adapts this layer

            def attend(h: torch.Tensor, i: int = layer_idx, layer: Qwen2DecoderLayer = layer,
                       pk: PackedLayer | None = pk, lo: LayerLora | None = lo) -> torch.Tensor:
                return self._self_attention(i, layer, pk, h, cos, sin, inp, mask, lora, lo)

            mlp = layer.mlp if pk is None else partial(_packed_mlp, pk, lora, lo)  # one GEMM for gate and up
            x = layer.residual(x, attend, mlp, self._norm)
        return x

    def _self_attention(self, layer_idx: int, layer: Qwen2DecoderLayer, pk: PackedLayer | None, h: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, inp: StepInputs, mask: torch.Tensor | None,
                        lora: StepLora | None = None, lo: LayerLora | None = None) -> torch.Tensor:
        """Normed hidden states h (N, D) -> the layer's attention output (N, D) over the paged cache, after
        writing the new positions' K/V. lora / lo: the step's adapter updates and this layer's (packed path)."""
        n_tok = h.shape[0]
        h_q, h_kv, dh = self.num_heads, self.num_kv_heads, self.head_dim
        attn = layer.self_attn
        if pk is not None:  # one GEMM for q, k, v; rotary over q and k in one pass
            qkv = gemm(h, pk.qkv_t, pk.qkv_bias)  # (N, Dq + 2 Dkv)
            if lora is not None and lo is not None:
                lora.add(qkv, h, lo.qkv)
            qk = apply_rotary(qkv[:, :pk.q_dim + pk.kv_dim].view(n_tok, h_q + h_kv, dh), cos, sin)
            q, k = qk[:, :h_q], qk[:, h_q:]  # (N, H, Dh), (N, Hkv, Dh)
            v = qkv[:, pk.q_dim + pk.kv_dim:].view(n_tok, h_kv, dh)
        else:
            q = apply_rotary(attn.q_proj(h).view(n_tok, h_q, dh), cos, sin)  # (N, H, Dh)
            k = apply_rotary(attn.k_proj(h).view(n_tok, h_kv, dh), cos, sin)  # (N, Hkv, Dh)
            v = attn.v_proj(h).view(n_tok, h_kv, dh)
        k_cache, v_cache = self.k_cache[layer_idx], self.v_cache[layer_idx]  # (slots, Hkv, Dh)
        k_cache.index_copy_(0, inp.write_slots, k.to(self.dtype))
        v_cache.index_copy_(0, inp.write_slots, v.to(self.dtype))
        o = self._attention(q, k_cache, v_cache, inp, mask)  # (N, H*Dh)
        if pk is None:
            return attn.o_proj(o)
        out = gemm(o, pk.o_t)  # (N, D)
        return out if lora is None or lo is None else lora.add(out, o, lo.o)

    def _head(self, x: torch.Tensor, inp: StepInputs) -> torch.Tensor:
        """Final hidden states (N, D) -> log-probs (R, V) of the sampled rows."""
        if self.adapter_bank is not None and inp.adapter_rows is not None:  # the head sees the sampled rows only
            self.adapter_bank.rows = inp.adapter_rows.index_select(0, inp.sample_rows)
        return self._logits(x.index_select(0, inp.sample_rows)).float().log_softmax(dim=-1)  # (R, V)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden states (M, D) -> speech-head logits (M, V): the final norm, then `llm_decoder`."""
        return self.llm.llm_decoder(self._norm(self.llm.qwen.norm, x))

    @staticmethod
    def _norm(norm: Qwen2RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """The module's RMSNorm as one fused op where input and weight share a dtype: fp32, or a whole-cast model's
        half dtype, whose fused kernel squares and sums in fp32 with no cast kernel either side (it rounds once,
        after the weight, where the module rounds before it)."""
        if x.dtype == norm.weight.dtype:
            return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)
        return norm(x)

    def _single_mask(self, inp: StepInputs) -> torch.Tensor | None:
        """SDPA mask (B, 1, 1, Lmax) of the single-query rows' real context; None when no row is padded."""
        if not inp.num_single or inp.valid is None or bool(inp.valid.all()):
            return None
        return inp.valid[:, None, None, :]

    def _attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, inp: StepInputs,
                   mask: torch.Tensor | None) -> torch.Tensor:
        n_tok = q.shape[0]
        hkv, g, dh = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        scale = dh**-0.5
        out = torch.empty(n_tok, self.num_heads * dh, dtype=q.dtype, device=q.device)
        b = inp.num_single
        if b:
            assert inp.gather_slots is not None
            lmax = inp.gather_slots.shape[1]
            # [index_select] advanced indexing (cache[slots]) takes a slow generic path on the CPU
            flat = inp.gather_slots.reshape(-1)
            k = k_cache.index_select(0, flat).view(b, lmax, hkv, dh).transpose(1, 2)  # (B, Hkv, Lmax, Dh)
            v = v_cache.index_select(0, flat).view(b, lmax, hkv, dh).transpose(1, 2)  # (B, Hkv, Lmax, Dh)
            qs = q[:b].reshape(b, hkv * g, 1, dh)  # (B, H, 1, Dh), query heads grouped by key/value head
            # one op instead of matmul/mask/softmax/matmul (no score tensor written and read back)
            o = F.scaled_dot_product_attention(qs, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                               enable_gqa=g > 1)  # (B, H, 1, Dh)
            out[:b] = o.reshape(b, -1)
        for pf in inp.prefills:
            n, c = pf.n, pf.slots.shape[0]
            k = k_cache.index_select(0, pf.slots).permute(1, 2, 0)  # (Hkv, Dh, c)
            v = v_cache.index_select(0, pf.slots).transpose(0, 1)  # (Hkv, c, Dh)
            qs = q[pf.start:pf.start + n].view(n, hkv, g, dh).permute(1, 2, 0, 3)  # (Hkv, G, n, Dh)
            scores = torch.matmul(qs, k[:, None].to(q.dtype)) * scale  # (Hkv, G, n, c)
            # query i sits at position computed + i and sees every key up to it
            query_pos = pf.computed + torch.arange(n, device=q.device)
            causal = torch.arange(c, device=q.device)[None, :] <= query_pos[:, None]  # (n, c)
            scores = scores.masked_fill(~causal, float("-inf"))
            o = torch.matmul(scores.softmax(dim=-1), v[:, None].to(q.dtype))  # (Hkv, G, n, Dh)
            out[pf.start:pf.start + n] = o.permute(2, 0, 1, 3).reshape(n, -1)
        return out


def _packed_mlp(pk: PackedLayer, lora: StepLora | None, lo: LayerLora | None, h: torch.Tensor) -> torch.Tensor:
    """h (N, D) -> (N, D); lora / lo: the step's adapter updates and this layer's (None: none)."""
    gate_up = gemm(h, pk.gate_up_t)  # (N, 2 I)
    if lora is not None and lo is not None:
        lora.add(gate_up, h, lo.gate_up)  # in place
    gate, up = gate_up.chunk(2, dim=-1)  # (N, I) each
    act = F.silu(gate) * up
    down = gemm(act, pk.down_t)  # (N, D)
    return down if lora is None or lo is None else lora.add(down, act, lo.down)
