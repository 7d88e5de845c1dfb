"""CosyVoice 2's batched, cached token2wav (a `protocol.Token2Wav`): speech tokens -> 24 kHz audio chunks.

Schedule (the reference `vocalis.reference.token2wav`'s, per request): the first hop is 25 tokens plus the
padding that ends the prompt and the first chunk on a 25-token block, later hops grow 25 -> 50 -> 100; a chunk
needs 3 look-ahead tokens after its hop; when the input has ended and no full hop remains, the rest is the
final chunk. HiFT holds back 8 mel frames / 3840 samples and cross-fades the seam, as the reference does.

Cost. Non-final chunks use the streaming (block-causal) flow incrementally: only the new tokens go through the
encoder and only the new frames through the Euler steps (`flow_steps`, default 10), reading earlier chunks'
keys/values from caches (`cv2.encoder`, `cv2.estimator`), so a request's flow work is linear in its length. A
voice's prompt prefix (its first 25 * floor((P - 3) / 25) tokens) is computed once per voice and shared
(`voice_cache.VoiceCache`, `cv2.voice_prefix`).

Memory. The caches cost ~4.4 MiB per token (2 mel frames) at the 0.5B shapes with the default bf16 storage
(twice that exact, `cache_dtype=None`): per request, only its own tokens (the prompt's last P - prefix tokens
and its generated ones), plus each voice's prefix once; `max_cache_mib` bounds the total (`budget.CacheBudget`).
The final chunk: `Token2WavConfig.final_attention`. Static shapes (GPUs): `Token2WavConfig.graphs`.

Legend: R requests in a step, P prompt tokens, N generated tokens, n new positions/frames.
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from vocalis.config import StreamConfig
from vocalis.frontend.prompt import FlowPrompt
from vocalis.kernels import bf16_gemm
from vocalis.kernels.threads import CoreWorkers
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.precision.dynamic_int8 import FusedQKV, Int8Conv1d, weight_count
from vocalis.token2wav.budget import CacheBudget, CacheOwner
from vocalis.token2wav.config import CACHE_DTYPES, Token2WavConfig
from vocalis.token2wav.cv2.compute import ComputeWeights
from vocalis.token2wav.cv2.encoder import EncoderCache, EncoderRow, EncoderStreamer
from vocalis.token2wav.cv2.estimator_cache import EstimatorCache
from vocalis.token2wav.cv2.hift import HiftBody
from vocalis.token2wav.cv2.hift_stream import HiftStreamer
from vocalis.token2wav.cv2.solver import TimeTerms, solve_chunk
from vocalis.token2wav.cv2.state import StreamState
from vocalis.token2wav.cv2.static_flow import StaticPath
from vocalis.token2wav.cv2.voice_prefix import VoicePrefix, start_caches
from vocalis.token2wav.protocol import Token2WavChunk, Token2WavStats, Work
from vocalis.token2wav.voice_cache import VoiceCache, voice_key

log = logging.getLogger(__name__)

# where a request's incremental chunk starts: its encoder cache, its estimator caches, whether the chunk extends them
_Start = tuple[EncoderCache, list[EstimatorCache], bool]


class Token2WavEngine(CacheOwner[StreamState, VoicePrefix]):
    """Shared flow + HiFT modules driven for many requests; all per-request data lives on `StreamState`
    (a `protocol.Token2Wav`)."""

    def __init__(self, flow: CausalMaskedDiffWithXvec, hift: HiFTGenerator, config: Token2WavConfig | None = None,
                 stream: StreamConfig | None = None, hift_body: HiftBody | None = None) -> None:
        """hift_body replaces the torch HiFT conv body (default: the one a backend attached to `hift`).
        Precision needs no argument: backends swap the modules' Linear layers (see backends/choice.py)."""
        self.flow = flow
        self.hift = hift
        self.config = config or Token2WavConfig()
        self.stream = stream or StreamConfig()
        # A backend may attach a batched HiFT body (e.g. ONNX Runtime) to the module; see backends/choice.py.
        self.hift_body = hift_body or getattr(hift, "backend_body", None)
        # The incremental path calls the torch estimator's parts; a backend may have swapped the module used by
        # full passes for a wrapper that keeps the original as `torch_module`.
        est = flow.decoder.estimator
        self.estimator = getattr(est, "torch_module", getattr(est, "_orig_mod", est))
        self.encoder = EncoderStreamer(flow)
        steps = self.config.flow_steps
        self.n_timesteps = flow.config.cfm.n_timesteps if steps is None else steps
        self.cache_dtype = CACHE_DTYPES[self.config.cache_dtype]
        self.compute = self._compute_weights()
        # int8 estimator Linears (fbgemm) run as the modules, but each attention's q/k/v as one GEMM (same values)
        self.qkv = FusedQKV() if self.compute is None and self.config.compute != "modules" else None
        self.time_terms = TimeTerms(self.estimator)
        self.ratio = flow.config.token_mel_ratio
        self.static = None if self.config.graphs == "off" else StaticPath(self)  # whole-prefix calls, bucketed
        self.vocoder = HiftStreamer(hift, self.hift_body or (self.static and self.static.body), self.stream)
        self.stats = Token2WavStats()
        self._live: weakref.WeakSet[StreamState] = weakref.WeakSet()
        self._voices: VoiceCache[VoicePrefix] = VoiceCache(self.config.voice_cache_size, self.stats,
                                                           lambda: [s.voice for s in list(self._live)])
        device = flow.input_embedding.weight.device
        self.cache_budget = self.config.cache_budget_bytes(device)
        # requests of one step run in this many parts side by side, one core each (`CoreWorkers`, made on first use)
        weights = weight_count(self.estimator)
        self.workers = self.config.step_workers(device, torch.get_num_threads(),
                                                native=self.compute is not None and bool(self.compute.native),
                                                own_vocoder=self.hift_body is not None)
        self._core_workers: CoreWorkers | None = None
        self.max_batch = self.config.step_batch(device, weights, self.workers)
        if self.workers > 1:
            log.info("token2wav: a step's requests run in up to %d parts side by side, one core each", self.workers)
        self.held = 0  # streams waiting for cache room after the last step
        self.budget = CacheBudget(self)

    def _compute_weights(self) -> ComputeWeights | None:
        """Reduced-dtype compute for the incremental estimator when a backend reduced its Linear weights."""
        if self.config.compute == "modules":
            return None
        dtype = ComputeWeights.dtype_for(self.estimator)
        if dtype is not None:
            # decided here, at load, so a first use of the native kernels (built once per machine) is no request's
            native = self.config.native_kernels and bf16_gemm.serves(dtype, self.flow.input_embedding.weight.device)
            if native:
                log.info("token2wav estimator (incremental path): native bf16 kernels, one call per transformer block")
            return ComputeWeights(dtype, native=native, native_attention=self.config.native_kernels)
        # int8 (fbgemm Linear layers) keeps the modules: bf16 conv GEMMs around them measured no faster
        return None

    # ---- requests -----------------------------------------------------------------------------------
    def new_stream(self, request_id: str, prompt: FlowPrompt, *, streaming: bool = True, speed: float = 1.0,
                   generator: torch.Generator | None = None) -> StreamState:
        state = StreamState(request_id, prompt, streaming, speed, generator, hop=self.stream.token_hop_len)
        self._live.add(state)
        return state

    def abort(self, state: StreamState) -> None:
        state.finished = True
        self.release(state)

    def this_hop(self, state: StreamState) -> int:
        if state.chunks_done == 0:
            p, chunk = state.num_prompt_tokens, self.stream.token_hop_len
            return state.hop + math.ceil(p / chunk) * chunk - p
        return state.hop

    def tokens_short(self, state: StreamState) -> int:
        """Generated tokens a streaming request still needs for its next non-final chunk (its hop plus the
        look-ahead); <= 0 when the chunk is ready."""
        return self.this_hop(state) + self.stream.pre_lookahead_len - (len(state.tokens) - state.token_offset)

    def next_work(self, state: StreamState) -> Work | None:
        """"chunk" (a non-final streaming chunk is ready), "final", or None (waiting for tokens)."""
        if state.finished:
            return None
        if state.streaming:
            if self.tokens_short(state) <= 0:
                return "chunk"
            return "final" if state.input_done else None
        return "final" if state.input_done else None

    # ---- the step -------------------------------------------------------------------------------------
    def step(self, states: Sequence[StreamState], *, hold_new: bool = False) -> list[Token2WavChunk]:
        """One batched pass over every state with work (at most `max_batch`); returns their chunks in order.
        Which new streams start their caches (`wait_for_cache`, `hold_new`): `budget.CacheBudget.admit`."""
        self.drop_unread(states)
        ready = ((s, kind == "final") for s in states if (kind := self.next_work(s)) is not None)
        work = self.budget.admit(ready, self.max_batch, hold_new)
        if not work:
            return []
        chunks: dict[int, Token2WavChunk] = {}
        todo = []
        for s, final in work:
            if final and not s.tokens:  # nothing was generated: end the request with no audio
                chunks[id(s)] = self._emit(s, np.zeros(0, dtype=np.float32), True)
            else:
                todo.append((s, final))
        if todo:
            for (s, final), wav in zip(todo, self._synthesize(todo)):
                chunks[id(s)] = self._emit(s, wav, final)
        self.stats.steps += 1
        self.stats.rows += len(todo)
        self.drop_unread([s for s, _ in work])
        return [chunks[id(s)] for s, _ in work]

    def _synthesize(self, todo: list[tuple[StreamState, bool]]) -> list[np.ndarray]:
        """Flow and HiFT for a step's requests -> each one's audio, in order. What requests share (the cache budget,
        voice prefixes, the stats) is settled here on the calling thread; after that each request's work touches
        only its own state, so with `workers` the requests run in parts side by side, one core each."""
        if self.static is not None:  # no caches: no prefixes, no budget, no parts
            with torch.inference_mode():
                return self._vocode(todo, self.static.mels(todo))
        inc = [(s, f) for s, f in todo if not self._needs_full_pass(s, f)]
        with torch.inference_mode():  # a new voice's prefix is computed here
            starts = self._start_incremental(inc) if inc else {}
        frames = sum(s.estimator_frames for s, _ in todo)
        parts = self._parts(todo, starts)
        if len(parts) == 1:
            audio = self._run_part(todo, starts)
        else:
            if self._core_workers is None or self._core_workers.pid != os.getpid():
                self._core_workers = CoreWorkers(self.workers)
            done = self._core_workers.map(lambda part: self._run_part(part, starts), parts)
            by_id = {id(s): wav for part, wavs in zip(parts, done) for (s, _), wav in zip(part, wavs)}
            audio = [by_id[id(s)] for s, _ in todo]
        self.stats.estimator_frames += sum(s.estimator_frames for s, _ in todo) - frames
        return audio

    def _parts(self, todo: list[tuple[StreamState, bool]], starts: dict[int, _Start]
               ) -> list[list[tuple[StreamState, bool]]]:
        """The step's requests in at most `workers` parts of about equal work (largest first, each to the part
        with the least so far), by the tokens each takes through the flow."""
        count = min(self.workers, len(todo))
        if count < 2:
            return [todo]
        tokens = [self._chunk_end(s, final) - (starts[id(s)][0].num_tokens if id(s) in starts else 0)
                  for s, final in todo]
        parts: list[list[tuple[StreamState, bool]]] = [[] for _ in range(count)]
        load = [0] * count
        for j in sorted(range(len(todo)), key=tokens.__getitem__, reverse=True):
            i = load.index(min(load))
            parts[i].append(todo[j])
            load[i] += tokens[j]
        return parts

    def _run_part(self, items: list[tuple[StreamState, bool]], starts: dict[int, _Start]) -> list[np.ndarray]:
        """Flow then HiFT for some of a step's requests (on any thread) -> their audio, in order."""
        full = [s for s, f in items if self._needs_full_pass(s, f)]
        inc = [(s, f) for s, f in items if not self._needs_full_pass(s, f)]
        mels: dict[int, torch.Tensor] = {}
        with torch.inference_mode():  # per thread: the workers' own
            if inc:
                mels.update(self._flow_incremental(inc, [starts[id(s)] for s, _ in inc]))
            if full:
                mels.update(self._flow_full(full))
            return self._vocode(items, [mels[id(s)] for s, _ in items])

    def _needs_full_pass(self, s: StreamState, final: bool) -> bool:
        return final and (not s.streaming or self.config.final_attention == "full")

    def ends_with_full_pass(self, s: StreamState, after_this_chunk: bool = False) -> bool:
        if not s.input_done or not self._needs_full_pass(s, True):
            return False
        if not after_this_chunk:
            return self.tokens_short(s) > 0
        after = s.token_offset + self.this_hop(s)  # generated tokens emitted once this chunk is
        return len(s.tokens) - after < self.stream.grown_hop(s.hop) + self.stream.pre_lookahead_len

    def _emit(self, s: StreamState, wav: np.ndarray, final: bool) -> Token2WavChunk:
        index = s.chunks_done
        if final:
            s.finished = True
            self.release(s)
        else:
            hop = self.this_hop(s)
            s.hops.append(hop)
            s.token_offset += hop
            s.hop = self.stream.grown_hop(s.hop)
        s.chunks_done += 1
        return Token2WavChunk(s.request_id, wav, final, index)

    # ---- flow -------------------------------------------------------------------------------------------
    def _all_ids(self, s: StreamState) -> torch.Tensor:
        prompt = s.prompt.speech_ids.reshape(-1).long()
        return torch.cat([prompt, torch.tensor(s.tokens, dtype=torch.long)])  # (P + N,)

    def _chunk_end(self, s: StreamState, final: bool) -> int:
        """The token (prompt included) the request's next chunk ends at."""
        return s.num_prompt_tokens + (len(s.tokens) if final else s.token_offset + self.this_hop(s))

    def _start_incremental(self, items: list[tuple[StreamState, bool]]) -> dict[int, _Start]:
        """The caches each request's incremental chunk starts from, by id(state): the cache budget enforced, and a
        new request's voice prefix looked up or computed (shared engine state: the calling thread's work)."""
        self.budget.enforce([s for s, final in items if s.cached and not final])
        starts: dict[int, _Start] = {}
        for s, final in items:
            if s.cached:
                if s.enc_cache is None:
                    s.voice = self._voice_prefix(s)
                    s.enc_cache, s.est_caches = start_caches(s.voice)
                # the last chunk before a final full pass keeps nothing: no chunk would read it
                keep = not final and not self.ends_with_full_pass(s, after_this_chunk=True)
                starts[id(s)] = (s.enc_cache, s.est_caches, keep)
            else:  # over budget: this chunk runs from the voice prefix and keeps nothing
                starts[id(s)] = (*start_caches(self._voice_prefix(s)), False)
        return starts

    def _flow_incremental(self, items: list[tuple[StreamState, bool]], starts: list[_Start]
                          ) -> dict[int, torch.Tensor]:
        """Streaming-mask flow on each request's new tokens, from the caches `_start_incremental` gave it ->
        emitted mel (80, frames) per state."""
        rows, emit_from, caches = [], [], []
        for (s, final), (enc, est, keep) in zip(items, starts):
            rows.append(EncoderRow(self._all_ids(s), enc.num_tokens, self._chunk_end(s, final), final, enc,
                                   keep=keep))
            caches.append(est)
            emit_from.append(s.num_prompt_tokens + s.token_offset)
        mu, lens = self.encoder.forward(rows)
        mu = mu.transpose(1, 2)  # (R, 80, n)
        spks, cond = self._conditions([s for s, _ in items], [r.start for r in rows], mu)
        starts = [r.start * self.ratio for r in rows]
        mel = solve_chunk(self.flow.decoder, self.estimator, mu, spks, cond, starts, lens,
                          caches, [r.keep for r in rows], self.n_timesteps, self.cache_dtype, self.compute,
                          self.time_terms, qkv=self.qkv)
        out = {}
        for i, (s, _) in enumerate(items):
            s.estimator_frames += lens[i] * self.n_timesteps
            s.encoder_tokens += rows[i].end - rows[i].start
            skip = (emit_from[i] - rows[i].start) * self.ratio
            out[id(s)] = mel[i, :, skip : lens[i]]
        return out

    def _conditions(self, states: list[StreamState], starts: list[int], mu: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected speaker vectors (R, 80) and the prompt-mel condition of each row's frames (R, 80, n)."""
        emb = torch.cat([s.prompt.embedding.reshape(1, -1) for s in states]).to(mu.device)
        spks = self.flow.speaker_projection(emb).to(mu.dtype)
        cond = torch.zeros_like(mu)
        for r, (s, start) in enumerate(zip(states, starts)):
            prompt_mel = s.prompt.mel.reshape(-1, mu.shape[1])  # (2P, 80)
            lo = start * self.ratio
            hi = min(prompt_mel.shape[0], lo + mu.shape[2])
            if hi > lo:
                cond[r, :, : hi - lo] = prompt_mel[lo:hi].T.to(device=mu.device, dtype=mu.dtype)
        return spks, cond

    def _flow_full(self, states: list[StreamState]) -> dict[int, torch.Tensor]:
        """Full-attention flow over prompt + all tokens, rows padded -> emitted mel (80, frames) per state."""
        ids = [self._all_ids(s) for s in states]
        dev = self.flow.input_embedding.weight.device
        lens = torch.tensor([t.numel() for t in ids], device=dev)
        tokens = torch.zeros(len(ids), int(lens.max()), dtype=torch.long, device=dev)
        for r, t in enumerate(ids):
            tokens[r, : t.numel()] = t.to(dev)
        mu, valid = self.flow.encode(tokens, lens, streaming=False, finalize=True)  # (R, T, 80), (R, 1, T)
        mu = mu.transpose(1, 2).contiguous()  # (R, 80, T)
        spks, cond = self._conditions(states, [0] * len(states), mu)
        if self.config.compute == "modules":  # the modules as they are: the reference's own pass
            mel = self.flow.decoder(mu, valid.to(mu.dtype), spks, cond, n_timesteps=self.n_timesteps,
                                    streaming=False)
        else:  # the incremental estimator's pass (native kernels, time terms kept, the compute dtype where one is
            # set): fewer, larger calls than the modules' forward, the same values to float rounding
            frames = [int(n) * self.ratio for n in lens]
            mel = solve_chunk(self.flow.decoder, self.estimator, mu, spks, cond, [0] * len(states), frames,
                              [[] for _ in states], [False] * len(states), self.n_timesteps, None, self.compute,
                              self.time_terms, full_attention=True, qkv=self.qkv)
        out = {}
        for r, s in enumerate(states):
            frames = int(lens[r]) * self.ratio
            s.estimator_frames += frames * self.n_timesteps
            out[id(s)] = mel[r, :, (s.num_prompt_tokens + s.token_offset) * self.ratio : frames]
        return out

    # ---- voice prefix cache -------------------------------------------------------------------------------
    def cacheable_prefix(self, num_prompt_tokens: int) -> int:
        """Prompt tokens whose flow work is independent of the text that follows (0 if none)."""
        chunk, look = self.encoder.chunk, self.stream.pre_lookahead_len
        return chunk * ((num_prompt_tokens - look) // chunk) if num_prompt_tokens > look else 0

    def _voice_prefix(self, s: StreamState) -> VoicePrefix | None:
        """The shared prompt prefix a request starts from (computed on its voice's first use), or None."""
        pc = self.cacheable_prefix(s.num_prompt_tokens)
        if pc == 0 or self.config.voice_cache_size == 0:
            return None
        key = voice_key(s.prompt)
        return self._voices.lookup(key, lambda: self._compute_prefix(key, s.prompt, pc))

    def voice_users(self) -> dict[str, int]:
        """Live requests per held voice prefix (key -> count): the prefixes' reference counts."""
        counts = {key: 0 for key in self._voices}
        for s in list(self._live):
            if s.voice is not None:
                counts[s.voice.key] = counts.get(s.voice.key, 0) + 1
        return counts

    def _compute_prefix(self, key: str, prompt: FlowPrompt, pc: int) -> VoicePrefix:
        enc = EncoderCache()
        row = EncoderRow(prompt.speech_ids.reshape(-1).long(), 0, pc, False, enc, keep=True)
        mu, lens = self.encoder.forward([row])
        mu = mu.transpose(1, 2)
        holder = StreamState("voice-prefix", prompt)
        spks, cond = self._conditions([holder], [0], mu)
        est: list[EstimatorCache] = []
        solve_chunk(self.flow.decoder, self.estimator, mu, spks, cond, [0], lens, [est], [True], self.n_timesteps,
                    self.cache_dtype, self.compute, self.time_terms, qkv=self.qkv)
        self.stats.estimator_frames += lens[0] * self.n_timesteps
        return VoicePrefix(key, pc, enc, est)

    def voice_cache_bytes(self) -> int:
        """Bytes of the voice prefixes held (each once, however many requests share it)."""
        return sum(v.nbytes() for v in self._voices.values())

    # ---- cache memory budget --------------------------------------------------------------------------------
    def cache_bytes_per_token(self) -> int:
        """Flow cache bytes one cached token adds (estimator keys/values of its frames + encoder keys/values)."""
        e, c = self.estimator.config, self.flow.encoder.config
        blocks = e.n_blocks * (2 + e.num_mid_blocks)
        item = torch.empty(0, dtype=self.cache_dtype or torch.float32).element_size()
        est = 2 * blocks * 2 * e.num_heads * e.attention_head_dim * self.n_timesteps * item * self.ratio
        enc = 2 * (c.num_blocks + c.num_up_blocks * c.up_stride) * c.output_size * 4
        return est + enc

    def cache_bytes_per_stream(self) -> int:
        """Flow cache bytes a request holds whatever its length: the input tails of the estimator's causal convs
        (kernel - 1 frames each, both guidance rows, every Euler step), at most fp32."""
        convs = [m for m in self.estimator.modules()
                 if isinstance(m, (torch.nn.Conv1d, Int8Conv1d)) and m.kernel_size[0] > 1]
        return sum(2 * m.in_channels * (m.kernel_size[0] - 1) for m in convs) * self.n_timesteps * 4

    def started_streams(self) -> list[StreamState]:
        """Live requests holding flow caches of their own."""
        return [t for t in list(self._live) if t.cached and t.enc_cache is not None and not t.finished]

    def has_voice_prefix(self, prompt: FlowPrompt) -> bool:
        return voice_key(prompt) in self._voices

    def live_cache_bytes(self) -> int:
        """Flow cache bytes held by live requests (their own frames) and voice prefixes (each once)."""
        live = list(self._live)
        voices = {id(v): v for v in self._voices.values()}
        voices.update({id(s.voice): s.voice for s in live if s.voice is not None})
        return sum(s.cache_bytes() for s in live) + sum(v.nbytes() for v in voices.values())

    def starts_cache(self, s: StreamState) -> bool:
        """Its next chunk is non-final and would be the first to store flow caches (`wait_for_cache`)."""
        return (self.config.wait_for_cache and s.cached and s.enc_cache is None and self.cache_budget > 0
                and self.next_work(s) == "chunk" and not self.ends_with_full_pass(s, after_this_chunk=True))

    def _growth(self, s: StreamState, per_token: int, per_stream: int) -> int:
        """Cache bytes its next non-final chunk adds."""
        if s.enc_cache is not None:
            start, fixed = s.enc_cache.num_tokens, 0
        else:  # a new request stores only what follows its voice's shared prefix
            start = self.cacheable_prefix(s.num_prompt_tokens) if self.config.voice_cache_size else 0
            fixed = per_stream
        return (s.num_prompt_tokens + s.token_offset + self.this_hop(s) - start) * per_token + fixed

    def next_growth(self, s: StreamState) -> int:
        if self.next_work(s) == "final" or self.ends_with_full_pass(s, after_this_chunk=True):
            return 0  # a final chunk keeps no cache, nor does the last before a final full pass
        return self._growth(s, self.cache_bytes_per_token(), self.cache_bytes_per_stream())

    def start_need(self, s: StreamState) -> int:
        per_token, per_stream = self.cache_bytes_per_token(), self.cache_bytes_per_stream()
        after = self.stream.grown_hop(s.hop)
        need = self._growth(s, per_token, per_stream) + after * per_token
        prefix = self.cacheable_prefix(s.num_prompt_tokens) if self.config.voice_cache_size else 0
        if prefix and not self.has_voice_prefix(s.prompt):  # its voice's prefix is computed with it
            need += prefix * per_token + per_stream
        return need

    def _vocode(self, items: list[tuple[StreamState, bool]], mels: list[torch.Tensor]) -> list[np.ndarray]:
        return self.vocoder.vocode(items, mels)
