"""One call of the incremental estimator over its requests' caches (`ChunkRun`): causal convs with their cached
left context, attention of the new frames over cached + new keys/values, and the caches extended.

Attention in two parts: a voice prefix ends on a block boundary before every new frame, so it is fully visible
to all new queries. The queries of every request on one prefix attend to it in one batched call (the prefix's
keys read once, not copied per request), each request's queries attend to its own cached + new frames under the
block-causal mask, and the two partial softmaxes are merged exactly by their log-sum-exps (`attention.merge`).
A lone request (the first-chunk latency case) instead lays its keys out once and attends block by block, unmasked.

Native path (bf16 compute on AMX CPUs, `ComputeWeights.native`): a lone request or a uniform batch runs each
transformer block as one call (`ChunkRun.block`, bf16_block.cpp) that reads the prefix and cached keys where
they lie and takes the block-causal mask as per-query key limits; GEMMs (`bf16_gemm`) fuse bias, GELU and the
residual add; causal convs read their taps in place from a time-major bf16 copy of their input (no im2col).
Other batches keep the two-part attention above, on `bf16_attention` (which also serves bf16 compute on CPUs with
AVX512-BF16 and no AMX, where torch's GEMMs run the rest).

Legend: R requests, n new frames (padded), C channels, D transformer width, H heads, E head width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vocalis.kernels import bf16_attention, bf16_gemm, fp32_attention
from vocalis.models.flow.transformer import SelfAttention
from vocalis.precision.dynamic_int8 import FusedQKV, Int8Conv1d
from vocalis.token2wav.cv2.attention import attend, merge, runs_native
from vocalis.token2wav.cv2.compute import ComputeWeights
from vocalis.token2wav.cv2.estimator_cache import EstimatorCache

_MASK_BIAS = -1.0e10  # the estimator's additive mask value


class ChunkRun:
    """Walks the estimator for one call, pairing each conv/attention with its slot in the per-request caches."""

    def __init__(self, caches: list[EstimatorCache], lens: list[int], keeps: list[bool], chunk: int,
                 cache_dtype: torch.dtype | None = None, compute: ComputeWeights | None = None,
                 qkv: FusedQKV | None = None) -> None:
        self.caches = caches
        self.cache_dtype = cache_dtype
        self.compute = compute
        self.qkv = qkv  # int8 modules: each attention's q/k/v as one GEMM where it can
        # our attention kernels run unless the compute weights were told to keep off the native kernels
        self._native = compute is None or compute.native_attention
        self.lens = lens
        self.keeps = keeps
        self.chunk = chunk
        self.conv_index = 0
        self.block_index = 0
        # the attention mask of the call, built by the first transformer block: (additive bias, or None when it
        # hides nothing; the same as per-query key limits for the native kernels, None where every key is visible
        # or, for the two-part path's own keys, where none of our attention kernels runs)
        self._mask: tuple[torch.Tensor | None, torch.Tensor | None] | None = None

    def conv(self, conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
        """Causal conv x (2R, C, n) -> (2R, C_out, n), left context from the caches."""
        i = self.conv_index
        self.conv_index += 1
        ctx = conv.kernel_size[0] - 1
        if not all(len(c.tails) > i for c in self.caches):
            zero = x.new_zeros(2, x.shape[1], ctx)
            for c in self.caches:
                if len(c.tails) == i:
                    c.tails.append(zero)
        left = (self.caches[0].tails[i].to(x.dtype) if len(self.caches) == 1 else
                torch.cat([c.tails[i].to(x.dtype) for c in self.caches]))  # (2R, C, ctx), request-major
        if all(self.keeps) and all(m == self.lens[0] for m in self.lens):  # one copy, a view per request
            tails = _tail(left, x, self.lens[0])
            for r, c in enumerate(self.caches):
                c.tails[i] = tails[2 * r : 2 * r + 2]
        else:
            for r, c in enumerate(self.caches):
                if self.keeps[r]:
                    pair = slice(2 * r, 2 * r + 2)
                    c.tails[i] = _tail(left[pair], x[pair], self.lens[r])
        if isinstance(conv, Int8Conv1d):
            return conv.after(left, x)
        if self.compute is None:
            return F.conv1d(torch.cat([left, x], dim=2), conv.weight, conv.bias)
        return self.compute.conv(conv, x, left)

    def _own_bias(self, rows: int, n: int, width: int, starts: list[int], firsts: list[int], uniform: bool,
                  like: torch.Tensor) -> torch.Tensor | None:
        """The additive mask (2R, 1, n, L) over each request's own keys (own frame j at absolute frame
        firsts[r] + j): block-causal, padding hidden; None when it hides nothing. The same for every transformer
        block of the call, so it is built once. Prefix frames need none: they precede every new frame's block."""
        if self._mask is None:
            kj = torch.arange(width, device=like.device)
            count = 1 if uniform else len(starts)
            bias = like.new_full((count, 2, 1, n, width), _MASK_BIAS)
            for r in range(count):
                a, m, f = starts[r], self.lens[r], firsts[r]
                qi = torch.arange(a, a + m, device=like.device)
                limit = torch.clamp((qi // self.chunk + 1) * self.chunk, max=a + m) - f  # block end, own index
                bias[r, :, 0, :m] = torch.where(kj[None, :] < limit[:, None], 0.0, _MASK_BIAS).to(like.dtype)
            bias = (None if bool((bias == 0).all()) else bias.expand(rows // 2, 2, 1, n, width)
                    .reshape(rows, 1, n, width) if uniform else bias.view(rows, 1, n, width))
            limits = None if bias is None or not runs_native(like) else bf16_attention.limits_of(bias)
            self._mask = (bias, limits)
        return self._mask[0]

    def attention(self, attn: SelfAttention, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual (2R, n, D) fp32 + self-attention of new frames x (2R, n, D) over cached + new keys (the add
        fused into the output projection where `ComputeWeights` can: residual is then updated in place).

        Several requests: two parts, merged exactly by their log-sum-exps (`attention.merge`): every request's new
        queries against its own keys (own cached frames + new frames, block-causal mask), and the queries of all
        requests continuing one voice prefix against that prefix's keys as one batched attention (the prefix is the
        same for all of them and fully visible to new frames), so a shared prefix is read once per call, never
        copied per request. One request (or a uniform batch attending in bf16 on the CPU): one key sequence per
        request (`_attention_whole`)."""
        i = self.block_index
        self.block_index += 1
        rows, n, _ = x.shape
        h, e = attn.num_heads, attn.head_dim
        fused = None
        if self.compute is None and self.qkv is not None:
            fused = self.qkv.project(attn, x.reshape(rows * n, -1))
        if fused is not None:  # (2R * n, 3 * H * E): the three layers' values
            q, k, v = (fused.view(rows, n, 3, h, e)[:, :, j].transpose(1, 2) for j in range(3))  # (2R, H, n, E)
        elif self.compute is None:
            q = attn.to_q(x).view(rows, n, h, e).transpose(1, 2)  # (2R, H, n, E)
            k = attn.to_k(x).view(rows, n, h, e).transpose(1, 2)
            v = attn.to_v(x).view(rows, n, h, e).transpose(1, 2)
        else:  # one fused q/k/v GEMM; attention in fp32 unless `reduced_attention`
            qkv = self.compute.qkv(attn, x.reshape(rows * n, -1))
            reduced = self.compute.reduced_attention and x.device.type == "cpu"
            qkv = (qkv if reduced else qkv.float()).view(rows, n, 3, h, e)
            q, k, v = (qkv[:, :, j].transpose(1, 2) for j in range(3))  # (2R, H, n, E) each
        # a uniform batch attends as one key sequence per request in bf16 on the CPU, and where our fp32 kernel
        # reads the keys as pieces (a shared prefix read where it lies by every request: no copy, no merge);
        # elsewhere the two-part split reads a shared voice prefix once per call instead of copying it per request
        one_sequence = (q.dtype == torch.bfloat16 and q.device.type == "cpu") or self._reads_pieces(q)
        if len(self.caches) == 1 or (one_sequence and self._uniform([c.num_frames for c in self.caches], n)):
            result = self._attention_whole(i, q, k, v)
        else:
            result = self._attention_batched(i, q, k, v)
        result = result.view(rows, n, h * e)  # (2R, n, H*E)
        if self.compute is None:
            return residual + attn.to_out[0](result)  # to_out[1]: dropout, identity in eval
        return self.compute.linear_add_(residual, attn.to_out[0], result)

    def one_layout(self, n: int) -> bool:
        """Whether this call's requests share one key layout (one request, or a uniform batch): what `block` and
        the one-sequence attention need."""
        return len(self.caches) == 1 or self._uniform([c.num_frames for c in self.caches], n)

    def block(self, w: bf16_gemm.BlockWeights, x: torch.Tensor) -> None:
        """One transformer block in one native call (`bf16_block.cpp`): x (2R, n, D) fp32 contiguous, updated in
        place; the new frames' keys/values extend the caches (when kept). Requests of one layout (`one_layout`):
        each attends over (its voice prefix, its own cached frames, the new frames) under the block-causal limits,
        the prefix and the cached frames read where they lie."""
        i = self.block_index
        self.block_index += 1
        n = x.shape[1]
        c0 = self.caches[0]
        p, start = _prefix_frames(c0), c0.num_frames
        cached_k, cached_v, own_k, own_v = [], [], None, None
        if p:
            cached_k.append(c0.prefix.keys[i].to(torch.bfloat16))  # (2, H, p, E): row b reads b % 2
            cached_v.append(c0.prefix.values[i].to(torch.bfloat16))
        if start > p:
            own_k, own_v = (t.to(torch.bfloat16) for t in self._held(i))
            cached_k.append(own_k)
            cached_v.append(own_v)
        self._whole_bias(start, n, x)  # the call's mask: the block reads its key limits
        k_new, v_new = bf16_gemm.transformer_block(x, w, cached_k, cached_v, self._mask[1])
        self._new_own(i, k_new)
        if self.keeps[0]:  # the cache holds each request's own frames: earlier ones, then these
            self._keep(i, *(self._stored_new(new, own) for new, own in ((k_new, own_k), (v_new, own_v))))

    def _attention_whole(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Requests of one layout (one alone: every chunk of a lone stream, its first the latency case; or a
        uniform batch with bf16 attention on the CPU or with our fp32 kernel): each request's keys as one sequence
        (prefix, own cached, new) -> (2R, n, H, E), no log-sum-exp merge. Our fp32 kernel takes the three as pieces
        read where they lie (the prefix's two rows by every request, a bf16 cache widened as it packs); elsewhere
        they are laid out once (the prefix's keys are upcast from the cache dtype anyway). bf16 on the CPU: one
        call under the block-causal mask (one kernel call instead of two parts and a merge). Otherwise (one request)
        queries go block by block, each over exactly the keys its block sees: no mask and no masked work."""
        c0 = self.caches[0]
        self._new_own(i, k)
        rows, h, n, e = q.shape
        p, start = _prefix_frames(c0), c0.num_frames  # prefix frames; the first new frame (absolute)
        pre = c0.prefix
        held = self._held(i) if start > p else (None, None)  # each request's own cached frames
        pieces = start > 0 and self._reads_pieces(q)
        if start == 0:
            keys, values = k, v  # nothing cached: the projection's views
        elif pieces:  # our fp32 kernel reads each stretch where it lies, widening a bf16 cache as it packs
            keys, values = ([t for t in (None if pre is None else shared[i], own, new) if t is not None]
                            for shared, own, new in ((None if pre is None else pre.keys, held[0], k),
                                                     (None if pre is None else pre.values, held[1], v)))
            if self.keeps[0]:
                self._keep(i, *(self._stored(new) if own is None else torch.cat([own, new.to(own.dtype)], 2)
                                for new, own in ((k, held[0]), (v, held[1]))))
        else:
            keys, values = q.new_empty(rows, h, start + n, e), q.new_empty(rows, h, start + n, e)
            for buf, new, own, shared in ((keys, k, held[0], None if pre is None else pre.keys),
                                          (values, v, held[1], None if pre is None else pre.values)):
                if shared is not None:  # (2, H, p, E) into every request's row pair
                    buf.view(rows // 2, 2, h, start + n, e)[:, :, :, :p] = shared[i]
                if own is not None:
                    buf[:, :, p:start] = own
                buf[:, :, start:] = new
        if self.keeps[0] and not pieces:  # a reduced dtype is for storage: this chunk attended at full
            self._keep(i, self._stored(keys[:, :, p:]), self._stored(values[:, :, p:]))
        if _one_call(q, self._native):
            bias = self._whole_bias(start, n, q)
            out, _ = attend(q, keys, values, None if bias is None else bias.expand(rows, -1, -1, -1),
                            self._mask[1], heads_first=False, native=self._native)
            return out  # (2R, n, H, E)
        result = q.new_empty(rows, n, h, e)  # the output projection's layout
        a = start
        while a < start + n:  # one piece per block: every query in it sees the keys up to its block's end
            end = min((a // self.chunk + 1) * self.chunk, start + n)
            out, _ = attend(q[:, :, a - start : end - start], keys[:, :, :end], values[:, :, :end], None,
                            native=self._native)
            result[:, a - start : end - start] = out.transpose(1, 2)
            a = end
        return result

    def _whole_bias(self, start: int, n: int, like: torch.Tensor) -> torch.Tensor | None:
        """The block-causal additive mask (1, 1, n, start + n) of new frames over all of a request's keys; None
        when every query sees every key (the new frames lie in one block). Built by the first transformer block
        of the call, with the same as key limits (`_block_limits`) beside it in `_mask`."""
        if self._mask is None:
            limits = _block_limits(start, n, self.chunk)  # (1, n): a query sees the keys up to its block's end
            kj = torch.arange(start + n, device=like.device)
            self._mask = (None if limits is None else
                          torch.where(kj[None, :] < limits[0, :, None].to(like.device), 0.0, _MASK_BIAS)
                          .to(like.dtype)[None, None], limits)
        return self._mask[0]

    def _attention_batched(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Several requests: own parts under the block-causal mask, prefix parts batched per voice, merged by
        log-sum-exp -> (2R, n, H, E)."""
        rows, h, n, e = q.shape
        starts = [c.num_frames for c in self.caches]  # each request's first new frame (prefix + own so far)
        firsts = [_prefix_frames(c) for c in self.caches]  # each request's first own frame
        uniform = self._uniform(starts, n)
        own_k, own_v = (self._own_uniform if uniform else self._own)(i, k, v, starts, firsts)  # (2R, H, L, E)
        bias = self._own_bias(rows, n, own_k.shape[2], starts, firsts, uniform, q)
        out, lse = attend(q, own_k, own_v, bias, self._mask[1], native=self._native)  # (2R, H, n, E), (2R, H, n)
        groups: dict[int, list[int]] = {}
        for r, c in enumerate(self.caches):
            if c.prefix is not None:
                groups.setdefault(id(c.prefix), []).append(r)
        result = q.new_empty(rows, n, h, e)  # the output projection's layout
        merged = False
        for reqs in groups.values():
            prefix = self.caches[reqs[0]].prefix
            pk, pv = prefix.keys[i], prefix.values[i]  # (2, H, P, E)
            if not self._reads_pieces(q):
                pk, pv = pk.to(q.dtype), pv.to(q.dtype)  # once per call
            every = len(reqs) == len(self.caches)
            q5 = q.view(-1, 2, h, n, e)  # (R, 2, H, n, E)
            qg = (q5 if every else q5[reqs]).permute(1, 2, 0, 3, 4).reshape(2, h, -1, e)  # (2, H, R_g * n, E)
            out_p, lse_p = attend(qg, pk, pv, None, native=self._native)
            out_p = out_p.view(2, h, len(reqs), n, e).permute(2, 0, 1, 3, 4)  # (R_g, 2, H, n, E)
            lse_p = lse_p.view(2, h, len(reqs), n).permute(2, 0, 1, 3)  # (R_g, 2, H, n)
            if every:
                merge(out.view(-1, 2, h, n, e), lse.view(-1, 2, h, n), out_p, lse_p,
                      result.view(-1, 2, n, h, e).transpose(2, 3))
                merged = True
            else:
                idx = torch.tensor(reqs, device=q.device)
                o5, l5 = out.view(-1, 2, h, n, e), lse.view(-1, 2, h, n)
                part = torch.empty_like(out_p)
                merge(o5[idx], l5[idx], out_p, lse_p, part)
                out = out.view(-1, 2, h, n, e).index_copy(0, idx, part).view(rows, h, n, e)
        if not merged:
            result.copy_(out.transpose(1, 2))
        return result

    def _uniform(self, starts: list[int], n: int) -> bool:
        """Whether every request has the same layout (same voice prefix, same cached frames, n new frames, same
        keep): the common case of streams started together, gathered with a few whole-batch copies."""
        c0 = self.caches[0]
        return all(c.prefix is c0.prefix and s == starts[0] and m == n and keep == self.keeps[0]
                   for c, s, m, keep in zip(self.caches, starts, self.lens, self.keeps))

    def _reads_pieces(self, q: torch.Tensor) -> bool:
        """Whether q's attention runs on our fp32 kernel, which reads keys as pieces in the cache dtype (fp32 or
        bf16: the voice prefixes and every request's own frames are stored in it) where they lie: no upcast copy
        of a cached stretch, no one-sequence layout."""
        return (self._native and q.dtype == torch.float32 and self.cache_dtype in (None, torch.bfloat16)
                and fp32_attention.supports(q))

    def _held(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block i's own cached keys and values of every request, request-major (2R, H, held, E) in the cache
        dtype (one request's as they lie)."""
        if len(self.caches) == 1:
            return self.caches[0].keys[i], self.caches[0].values[i]
        return torch.cat([c.keys[i] for c in self.caches]), torch.cat([c.values[i] for c in self.caches])

    def _keep(self, i: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Block i's caches from request-major (2R, H, L, E) keys/values: each request's row pair (views)."""
        for r, c in enumerate(self.caches):
            c.keys[i], c.values[i] = keys[2 * r : 2 * r + 2], values[2 * r : 2 * r + 2]

    def _stored(self, t: torch.Tensor) -> torch.Tensor:
        """A fresh contiguous copy of t in the cache dtype (never a view: t may alias a whole-batch buffer)."""
        return t.to(dtype=self.cache_dtype or t.dtype, memory_format=torch.contiguous_format, copy=True)

    def _stored_new(self, new: torch.Tensor, own: torch.Tensor | None) -> torch.Tensor:
        """The cache tensor of (own cached frames, new frames): a fresh `new` in the cache dtype is kept as is."""
        if own is None and new.dtype == (self.cache_dtype or new.dtype):
            return new
        return self._stored(new if own is None else torch.cat([own, new], dim=2))

    def _new_own(self, i: int, k: torch.Tensor) -> None:
        """Empty own key/value caches for block i of requests on their first chunk."""
        for c in self.caches:
            if len(c.keys) == i:  # first chunk of this request: no own frames yet
                c.keys.append(k.new_zeros(2, k.shape[1], 0, k.shape[3], dtype=self.cache_dtype or k.dtype))
                c.values.append(k.new_zeros(2, k.shape[1], 0, k.shape[3], dtype=self.cache_dtype or k.dtype))

    def _own_uniform(self, i: int, k: torch.Tensor, v: torch.Tensor, starts: list[int], firsts: list[int]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_own` for uniform requests: whole-batch copies (each op costs a thread-pool round trip), and a
        request's new cache is its slice of one batch tensor."""
        self._new_own(i, k)
        held = starts[0] - firsts[0]  # own cached frames, the same for all
        out = []
        for new, store in ((k, [c.keys for c in self.caches]), (v, [c.values for c in self.caches])):
            if held == 0:
                own = new  # a view of the projection: nothing to copy
            else:
                own = new.new_empty(new.shape[0], new.shape[1], held + new.shape[2], new.shape[3])
                own[:, :, :held] = torch.cat([s[i] for s in store])  # (2R, H, held, E), upcast
                own[:, :, held:] = new
            if self.keeps[0]:  # a reduced dtype is for storage: this chunk attended at full
                kept = self._stored(own)
                for r, s in enumerate(store):
                    s[i] = kept[2 * r : 2 * r + 2]
            out.append(own)
        return out[0], out[1]

    def _own(self, i: int, k: torch.Tensor, v: torch.Tensor, starts: list[int], firsts: list[int]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Lay each request's own keys/values (own cached frames, then new) out from position 0 of its rows of
        (2R, H, L, E) tensors, L the longest, padding zeroed (finite, so the -1e10 mask gives it weight exactly
        0), and extend its caches with its new frames."""
        self._new_own(i, k)
        rows, h, _, e = k.shape
        width = max(a - f + m for a, f, m in zip(starts, firsts, self.lens))
        out = []
        for new, store in ((k, [c.keys for c in self.caches]), (v, [c.values for c in self.caches])):
            own = new.new_empty(rows, h, width, e)
            for r, s in enumerate(store):
                held, m = starts[r] - firsts[r], self.lens[r]
                pair = slice(2 * r, 2 * r + 2)  # the request's conditional and unconditional rows
                own[pair, :, :held] = s[i]
                own[pair, :, held : held + m] = new[pair, :, :m]
                own[pair, :, held + m :] = 0
                if self.keeps[r]:
                    s[i] = self._stored(own[pair, :, : held + m])
            out.append(own)
        return out[0], out[1]


def _block_limits(start: int, n: int, chunk: int) -> torch.Tensor | None:
    """Keys visible to each of n new frames from absolute frame `start` over all of a request's keys: up to its
    block's end, (1, n) int32; None when every query sees every key (the new frames lie in one block)."""
    qi = torch.arange(start, start + n)
    limit = torch.clamp((qi // chunk + 1) * chunk, max=start + n)
    return None if int(limit.min()) >= start + n else limit.to(torch.int32)[None]


def _tail(left: torch.Tensor, x: torch.Tensor, m: int) -> torch.Tensor:
    """The last ctx frames before frame m of (left context, x): left (B, C, ctx), x (B, C, n) -> a new (B, C, ctx)
    tensor (the next chunk's left context)."""
    ctx = left.shape[2]
    if m >= ctx:
        return x[:, :, m - ctx : m].clone()
    return torch.cat([left[:, :, m:], x[:, :, :m]], dim=2)


def _one_call(q: torch.Tensor, native: bool) -> bool:
    """Whether attention over a request's whole key sequence runs as one masked call (bf16 on the CPU, or fp32
    where our fp32 kernel runs: it skips hidden keys by limits) rather than one call per block (fp32 on torch's
    kernel, which works on every key under a mask)."""
    if q.device.type != "cpu":
        return False
    return q.dtype == torch.bfloat16 or (native and fp32_attention.supports(q))


def _prefix_frames(cache: EstimatorCache) -> int:
    """Frames a request reads from its voice's shared prefix (0 without one)."""
    return 0 if cache.prefix is None else cache.prefix.num_frames
