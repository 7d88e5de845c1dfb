"""Batched streaming token2wav for CosyVoice 3 (DiT flow + causal HiFT): speech tokens -> 24 kHz audio chunks.

A `protocol.Token2Wav` (`new_stream`, `next_work`, `tokens_short`, `step`, `abort`), as CosyVoice 2's
(`token2wav.cv2`), so the runtime drives either. The caller owns one `CV3StreamState` per request, appends the
LLM's ids (`add_tokens`: the silent-token filter applies; `add_source_tokens`: voice conversion's ids, unfiltered),
calls `end_input`, and calls `step(states)`.

Schedule (`cv3.schedule.StreamSchedule`, per request): the official CosyVoice 3 one. A call k re-runs the flow over
prompt + the first n_k tokens (block-causal DiT attention, the last 3 tokens only look-ahead; the final call:
full attention over all tokens, finalize) and keeps its mel from frame 2 * offset_k on; the causal HiFT re-runs over
all mel kept so far and the chunk is its output past the samples already yielded (here: the same samples, decoded
from a window of the mel).

Batching. One step runs every ready request's flow call as one padded solve: each row's mu (the pre-lookahead
encoding, per row: a non-final call's look-ahead context is per row), its prompt-mel condition and its own
attention mask (block-causal or full, valid keys only) go into one estimator batch of 2R rows (CFG) per Euler step.
Rows of a padded batch are independent in the DiT (masked keys, causal position convs, zeroed padded outputs), so
each row equals the request alone (to fp32 rounding of the batched GEMMs). The HiFT is not run padded: its source
STFT, iSTFT and look-right convs see the end of the signal, so a padded row would differ near its end. Rows of
equal length and finalize flag (lock-step requests of one voice) share a call; others run one call each.

Cost. A non-final call runs the DiT over its new frames only, reading the keys/values and position-conv tails
earlier calls left (`token2wav.cv3.dit`: why that is exact). The final call is a full pass (full attention, as
officially) unless `Token2WavConfig.final_attention` is "causal": then it too runs block-causally over its new
frames (keeping nothing), and a streaming request's flow work is linear in its length. One-shot requests are
full passes. The caches are bounded by `Token2WavConfig.max_cache_mib` (over it, the largest drop theirs and
later calls recompute their prefix, the official cost, same output; 0 never caches) and kept exact unless
`dit_cache_dtype` says otherwise. The causal HiFT decodes only the frames a call's new samples depend on
(`token2wav.cv3.vocoder`; `Token2WavConfig.vocoder_window`), so its work too is linear in the stream's length.

Legend: R requests in a step, P prompt tokens, n tokens of a call, T = 2 (P + n) mel frames (fewer 3 look-ahead
tokens when not final), Tmax the longest row, C = 80 mel channels.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch

from vocalis.config import StreamConfig
from vocalis.frontend.prompt import FlowPrompt
from vocalis.models.cv3.dit import dit_attention_mask
from vocalis.models.cv3.flow import CausalMaskedDiffWithDiT
from vocalis.models.cv3.hift import CausalHiFTGenerator
from vocalis.models.flow.cfm import cosine_time_grid
from vocalis.precision.dynamic_int8 import weight_count
from vocalis.token2wav.budget import CacheBudget, CacheOwner
from vocalis.token2wav.cache_storage import compact
from vocalis.token2wav.config import CACHE_DTYPES, Token2WavConfig
from vocalis.token2wav.cv3.dit import DiTCache, cache_bytes_per_frame, cache_bytes_per_stream, dit_new_frames
from vocalis.token2wav.cv3.schedule import FlowCall, StreamSchedule
from vocalis.token2wav.cv3.state import CV3StreamState
from vocalis.token2wav.cv3.static_flow import Cv3StaticFlow
from vocalis.token2wav.cv3.vocoder import VocoderRow, stretch, vocode
from vocalis.token2wav.protocol import Token2WavChunk, Token2WavStats, Work
from vocalis.token2wav.static_flow import FlowRow
from vocalis.token2wav.voice_cache import VoiceCache, voice_key

log = logging.getLogger(__name__)


class CV3Token2WavEngine(CacheOwner[CV3StreamState, list[DiTCache]]):
    """Shared DiT flow + causal HiFT modules driven for many requests; per-request data lives on the states
    (a `protocol.Token2Wav`)."""

    def __init__(self, flow: CausalMaskedDiffWithDiT, hift: CausalHiFTGenerator,
                 config: Token2WavConfig | None = None, stream: StreamConfig | None = None) -> None:
        """config: `max_batch`, `flow_steps`, `final_attention`, `max_cache_mib`, `voice_cache_size` and
        `dit_cache_dtype` apply (the compute and `cache_dtype` knobs are the CosyVoice 2 engine's)."""
        self.flow = flow
        self.hift = hift
        self.config = config or Token2WavConfig()
        self.stream = stream or StreamConfig()
        self.ratio = flow.config.token_mel_ratio
        steps = self.config.flow_steps
        self.n_timesteps = flow.config.cfm.n_timesteps if steps is None else steps
        self.chunk_frames = flow.estimator.config.static_chunk_size
        self.cache_dtype = CACHE_DTYPES[self.config.dit_cache_dtype]
        self.cache_budget = self.config.cache_budget_bytes(flow.input_embedding.weight.device)
        self.max_batch = self.config.step_batch(flow.input_embedding.weight.device, weight_count(flow.estimator))
        self.stats = Token2WavStats()
        self._live: weakref.WeakSet[CV3StreamState] = weakref.WeakSet()
        # voice key -> prefix caches per Euler step
        self._voices: VoiceCache[list[DiTCache]] = VoiceCache(self.config.voice_cache_size, self.stats,
                                                              lambda: [s.voice for s in list(self._live)])
        self.held = 0  # streams waiting for cache room after the last step (`wait_for_cache`)
        self.budget = CacheBudget(self)
        # static shapes (`Token2WavConfig.graphs`): every call over its whole prefix in buckets, no caches
        self.static = None if self.config.graphs == "off" else Cv3StaticFlow(
            flow, self.n_timesteps, self.config.graphs, CACHE_DTYPES[self.config.graph_dtype] or torch.float32)

    # ---- requests -----------------------------------------------------------------------------------
    def new_stream(self, request_id: str, prompt: FlowPrompt, *, streaming: bool = True, speed: float = 1.0,
                   generator: torch.Generator | None = None) -> CV3StreamState:
        """generator: unused (the causal HiFT's source is deterministic). speed != 1 stretches the mel, which the
        official code allows only in one piece: such a request is vocoded in one final call."""
        del generator
        if speed != 1.0 and streaming:
            log.info("request %s: speed %.2f is applied to the whole utterance (no streaming)", request_id, speed)
            streaming = False
        state = CV3StreamState(request_id, prompt,
                               StreamSchedule.start(int(prompt.speech_ids.shape[1]), self.stream), streaming, speed)
        self._live.add(state)
        return state

    def abort(self, state: CV3StreamState) -> None:
        state.finished = True
        self.release(state)

    def ends_with_full_pass(self, s: CV3StreamState, after_this_chunk: bool = False) -> bool:
        if not s.input_done:
            return False
        schedule = self._next_call(s)[1] if after_this_chunk else s.schedule
        call, _ = schedule.advance(len(s.tokens), True, self.stream)
        return call is not None and call.finalize and not self._incremental(s, call)

    def _keeps(self, s: CV3StreamState, call: FlowCall) -> bool:
        """Whether the call extends the request's caches: a non-final one, unless the next is a final full pass."""
        return not call.finalize and not self.ends_with_full_pass(s, after_this_chunk=True)

    def _next_call(self, s: CV3StreamState) -> tuple[FlowCall | None, StreamSchedule]:
        if s.finished:
            return None, s.schedule
        if not s.streaming:
            if not s.input_done:
                return None, s.schedule
            return FlowCall(len(s.tokens), 0, streaming=False, finalize=True), s.schedule
        return s.schedule.advance(len(s.tokens), s.input_done, self.stream)

    def tokens_short(self, state: CV3StreamState) -> int:
        """Tokens a streaming request still needs for its next non-final chunk; <= 0 when it is ready."""
        return state.schedule.tokens_needed(self.stream) - len(state.tokens)

    def next_work(self, state: CV3StreamState) -> Work | None:
        """"chunk" (a non-final chunk is ready), "final", or None (waiting for tokens)."""
        call, _ = self._next_call(state)
        if call is None:
            return None
        return "final" if call.finalize else "chunk"

    # ---- the step -------------------------------------------------------------------------------------
    def step(self, states: Sequence[CV3StreamState], *, hold_new: bool = False) -> list[Token2WavChunk]:
        """One batched flow solve and the vocoder calls for every given state with work (at most `max_batch`,
        in the given order); returns their chunks in that order.

        Over the cache budget, streams recompute their calls (`CacheBudget.enforce`), unless `wait_for_cache`: then a
        stream's first cached call starts only while the budget has room for it and its next hop beside the caches
        held and the started streams' next calls; the others wait, first come first served. With nothing else to do
        in the step the first waiting stream starts anyway, unless `hold_new` (the caller has LLM steps to run and
        will call again)."""
        self.drop_unread(states)
        ready = ((s, plan) for s in states if (plan := self._next_call(s))[0] is not None)
        work = [(s, call, after) for s, (call, after) in self.budget.admit(ready, self.max_batch, hold_new)
                if call is not None]
        chunks: dict[int, Token2WavChunk] = {}
        todo = []
        for s, call, after in work:
            if call.finalize and call.num_tokens == 0:  # nothing was generated: end with no audio
                chunks[id(s)] = self._emit(s, np.zeros(0, dtype=np.float32), call, after)
            else:
                todo.append((s, call, after))
        if todo:
            with torch.inference_mode():
                mels = self._flow([(s, c) for s, c, _ in todo])
                audio = self._vocode([(s, c) for s, c, _ in todo], mels)
            for (s, call, after), wav in zip(todo, audio):
                chunks[id(s)] = self._emit(s, wav, call, after)
        if work:
            self.stats.steps += 1
            self.stats.rows += len(todo)
        self.drop_unread([s for s, _, _ in work])
        return [chunks[id(s)] for s, _, _ in work]

    def _emit(self, s: CV3StreamState, wav: np.ndarray, call: FlowCall, after: StreamSchedule) -> Token2WavChunk:
        index = s.chunks_done
        s.schedule = after
        s.chunks_done += 1
        if call.finalize:
            s.finished = True
            self.release(s)
        return Token2WavChunk(s.request_id, wav, call.finalize, index)

    # ---- flow -------------------------------------------------------------------------------------------
    def _flow(self, items: list[tuple[CV3StreamState, FlowCall]]) -> list[torch.Tensor]:
        """Each row's new mel (C, frames from 2 (P + offset) on): non-final calls of caching requests (and with
        `final_attention="causal"` streaming requests' final calls) over their new frames, the rest as full
        passes."""
        if self.static is not None:
            return self._flow_static(items)
        inc = [i for i, (s, call) in enumerate(items) if self._incremental(s, call)]
        self.budget.enforce([items[i][0] for i in inc if not items[i][1].finalize])
        inc = [i for i in inc if items[i][0].cached or items[i][1].finalize]
        full = [i for i in range(len(items)) if i not in inc]
        out: dict[int, torch.Tensor] = {}
        if inc:
            out.update(zip(inc, self._flow_incremental([items[i] for i in inc])))
        if full:
            out.update(zip(full, self._flow_full([items[i] for i in full])))
        return [out[i] for i in range(len(items))]

    def _flow_static(self, items: list[tuple[CV3StreamState, FlowCall]]) -> list[torch.Tensor]:
        """`_flow` on the static-shape path: the same masks per call (block-causal for a causal final call)."""
        causal = self.config.final_attention == "causal"
        rows = [FlowRow(self._ids(s, call), 0 if call.finalize else self.stream.pre_lookahead_len, s.prompt,
                        call.streaming or (call.finalize and s.streaming and causal)) for s, call in items]
        out = []
        for (s, call), mel in zip(items, self.static(rows)):
            s.estimator_frames += mel.shape[1] * self.n_timesteps
            out.append(mel[:, s.prompt.mel.reshape(-1, mel.shape[0]).shape[0] + call.token_offset * self.ratio :])
        return out

    def _incremental(self, s: CV3StreamState, call: FlowCall) -> bool:
        if call.finalize:  # block-causal over the new frames, keeping nothing (the official call: full attention)
            return s.streaming and self.config.final_attention == "causal"
        return call.streaming and s.cached and self.cache_budget > 0

    def _ids(self, s: CV3StreamState, call: FlowCall) -> torch.Tensor:
        return torch.cat([s.prompt.speech_ids.reshape(-1).long(), torch.tensor(s.tokens[: call.num_tokens])])

    def _flow_incremental(self, items: list[tuple[CV3StreamState, FlowCall]]) -> list[torch.Tensor]:
        """The DiT over each row's new frames [cached, T_i) with its caches, one padded batch -> new mel per row."""
        flow = self.flow
        dev = flow.input_embedding.weight.device
        rows = []
        for s, call in items:
            ids = self._ids(s, call)
            lens = torch.tensor([ids.numel()], device=dev)
            mu = flow.encode(ids[None].to(dev), lens, finalize=call.finalize)[0]  # (T, C)
            if not s.dit:
                s.voice, s.dit = self._start_caches(s.prompt)
            start = s.dit[0].num_frames
            if start % self.chunk_frames or (mu.shape[0] % self.chunk_frames and not call.finalize):
                raise RuntimeError(f"request {s.request_id}: a streaming call off the attention blocks "
                                   f"({start} -> {mu.shape[0]} frames, blocks of {self.chunk_frames})")
            rows.append((s.prompt, mu, s.dit))
        keeps = [self._keeps(s, call) for s, call in items]
        x, lens = self._solve_new(rows, keeps)
        out = []
        for i, ((s, call), (_, _, caches)) in enumerate(zip(items, rows)):
            s.estimator_frames += lens[i] * self.n_timesteps
            start = caches[0].num_frames - (lens[i] if keeps[i] else 0)
            skip = s.num_prompt_tokens * self.ratio + call.token_offset * self.ratio - start
            out.append(x[i, skip : lens[i]].T.float())  # (C, new frames)
        return out

    def _solve_new(self, rows: list[tuple[FlowPrompt, torch.Tensor, list[DiTCache]]], keep: list[bool]
                   ) -> tuple[torch.Tensor, list[int]]:
        """`_solve`'s arithmetic on new frames only: per row its prompt, mu (T, C) of its frames so far and its
        caches per Euler step (extended to T where `keep`) -> x (R, n_max, C) of the frames [cached, T), the new
        frame counts."""
        flow = self.flow
        dev = flow.input_embedding.weight.device
        c = flow.config.output_size
        r = len(rows)
        lens = [mu.shape[0] - caches[0].num_frames for _, mu, caches in rows]
        mu_in = rows[0][1].new_zeros(2 * r, max(lens), c)  # rows [0, R) conditional, [R, 2R) unconditional (zeros)
        cond_in = torch.zeros_like(mu_in)
        x = torch.zeros(r, max(lens), c, dtype=mu_in.dtype, device=dev)
        for i, ((prompt, mu, caches), n) in enumerate(zip(rows, lens)):
            start = caches[0].num_frames
            mu_in[i, :n] = mu[start:]
            prompt_mel = prompt.mel.reshape(-1, c)[start : start + n]
            cond_in[i, : prompt_mel.shape[0]] = prompt_mel.to(device=dev, dtype=mu_in.dtype)
            x[i, :n] = flow.decoder.start_noise(1, start + n)[0, :, start:].T.to(device=dev, dtype=x.dtype)
        emb = torch.cat([prompt.embedding.reshape(1, -1) for prompt, _, _ in rows]).to(dev)
        spks = flow.speaker_projection(emb).to(mu_in.dtype)
        spks_in = torch.cat([spks, torch.zeros_like(spks)])

        def velocity(x2: torch.Tensor, t: torch.Tensor, step: int) -> torch.Tensor:
            caches = [row[2][step] for row in rows]
            v = dit_new_frames(flow.estimator, x2, mu_in, cond_in, spks_in, t, lens, caches, keep,
                               self.cache_dtype)  # (2R, n_max, C)
            if dev.type == "cpu":  # this step's new caches out of malloc's arenas (`cache_storage`)
                for cache, kept in zip(caches, keep):
                    if kept:
                        compact(cache)
            return v

        return self._euler(x, velocity), lens

    # ---- voice prefixes -----------------------------------------------------------------------------------
    def prefix_frames(self, num_prompt_tokens: int) -> int:
        """Leading prompt frames whose DiT work is independent of the text that follows: whole attention blocks
        ending by frame 2 (P - 3) (the last 3 prompt tokens look ahead into generated ones)."""
        look = self.ratio * (num_prompt_tokens - self.stream.pre_lookahead_len)
        return self.chunk_frames * (look // self.chunk_frames) if look > 0 else 0

    def _start_caches(self, prompt: FlowPrompt) -> tuple[list[DiTCache] | None, list[DiTCache]]:
        """A request's first caches: continuing its voice's prefix (computed on the voice's first use, shared by
        every request of the voice: `VoiceCache`), or empty; and the prefix they continue."""
        num = self.prefix_frames(int(prompt.speech_ids.shape[1]))
        if num == 0 or self.config.voice_cache_size == 0 or self.cache_budget == 0:
            return None, [DiTCache() for _ in range(self.n_timesteps)]
        entry = self._voices.lookup(voice_key(prompt), lambda: self._compute_prefix(prompt, num))
        return entry, [DiTCache.continuing(c) for c in entry]

    def _compute_prefix(self, prompt: FlowPrompt, num: int) -> list[DiTCache]:
        dev = self.flow.input_embedding.weight.device
        ids = prompt.speech_ids.reshape(1, -1).long().to(dev)
        mu = self.flow.encode(ids, torch.tensor([ids.shape[1]], device=dev), finalize=False)[0, :num]
        entry = [DiTCache() for _ in range(self.n_timesteps)]
        self._solve_new([(prompt, mu, entry)], [True])
        return entry

    def _flow_full(self, items: list[tuple[CV3StreamState, FlowCall]]) -> list[torch.Tensor]:
        """One padded solve over every row -> each row's mel (C, T_i - 2 (P + offset)), earlier frames removed."""
        flow = self.flow
        dev = flow.input_embedding.weight.device
        mus, num_frames = [], []
        for s, call in items:
            ids = self._ids(s, call)
            mu = flow.encode(ids[None].to(dev), torch.tensor([ids.numel()], device=dev), finalize=call.finalize)
            mus.append(mu[0])  # (T_i, C)
            num_frames.append(mu.shape[1])
        r, t_max, c = len(items), max(num_frames), flow.config.output_size
        mu = mus[0].new_zeros(r, t_max, c)
        cond = mus[0].new_zeros(r, t_max, c)
        mask = mus[0].new_zeros(r, 1, t_max)
        attn = []
        for i, (s, call) in enumerate(items):
            t = num_frames[i]
            mu[i, :t] = mus[i]
            prompt_mel = s.prompt.mel.reshape(-1, c)[:t]  # (2P, C)
            cond[i, : prompt_mel.shape[0]] = prompt_mel.to(device=dev, dtype=mu.dtype)
            mask[i, :, :t] = 1
            attn.append(dit_attention_mask(mask[i : i + 1], call.streaming, self.chunk_frames))  # (1, 1, Tmax, Tmax)
        emb = torch.cat([s.prompt.embedding.reshape(1, -1) for s, _ in items]).to(dev)
        spks = flow.speaker_projection(emb).to(mu.dtype)  # (R, C)
        mel = self._solve(mu.transpose(1, 2), mask, spks, cond.transpose(1, 2), torch.cat(attn))  # (R, C, Tmax)
        out = []
        for i, (s, call) in enumerate(items):
            s.estimator_frames += num_frames[i] * self.n_timesteps
            num_prompt_frames = s.prompt.mel.reshape(-1, c).shape[0]  # 2P, cut as `flow.inference` does
            out.append(mel[i, :, num_prompt_frames + call.token_offset * self.ratio : num_frames[i]])
        return out

    # ---- cache memory budget (`budget.CacheBudget` reads these) ---------------------------------------------
    def live_cache_bytes(self) -> int:
        """Requests' own caches and the voice prefixes held, each once (also one dropped from the voice cache
        while a request still reads it)."""
        states = list(self._live)
        prefixes = {id(c): c for entry in self._voices.values() for c in entry}
        prefixes.update((id(c.prefix), c.prefix) for s in states for c in s.dit if c.prefix is not None)
        return sum(s.cache_bytes() for s in states) + sum(c.nbytes() for c in prefixes.values())

    def frame_bytes(self) -> int:
        """Cache bytes of one frame over every Euler step."""
        dtype = self.cache_dtype or self.flow.input_embedding.weight.dtype
        return cache_bytes_per_frame(self.flow.estimator, dtype) * self.n_timesteps

    def growth(self, s: CV3StreamState, call: FlowCall) -> int:
        """Bytes a non-final cached call adds to the stream's caches (its new frames; the position-conv tails
        on its first call)."""
        cached = s.dit[0].num_frames if s.dit else 0
        frames = (s.num_prompt_tokens + call.num_tokens - self.stream.pre_lookahead_len) * self.ratio
        tails = 0 if s.dit else cache_bytes_per_stream(self.flow.estimator) * self.n_timesteps
        return (frames - cached) * self.frame_bytes() + tails

    def next_growth(self, s: CV3StreamState) -> int:
        call = self._next_call(s)[0]
        return 0 if call is None or not self._keeps(s, call) else self.growth(s, call)

    def started_streams(self) -> list[CV3StreamState]:
        return [t for t in list(self._live) if t.dit and not t.finished]

    def starts_cache(self, s: CV3StreamState) -> bool:
        call = self._next_call(s)[0]
        return (self.config.wait_for_cache and not s.dit and s.chunks_done == 0 and call is not None
                and not call.finalize and self._incremental(s, call) and self._keeps(s, call))

    def start_need(self, s: CV3StreamState) -> int:
        call = self._next_call(s)[0]
        assert call is not None, "start_need of a stream with no call ready"
        hop = self.stream.grown_hop(s.schedule.hop)
        need = self.growth(s, FlowCall(call.num_tokens + hop, call.num_tokens, streaming=True, finalize=False))
        prefix = self.prefix_frames(s.num_prompt_tokens)
        if prefix and self.config.voice_cache_size and voice_key(s.prompt) not in self._voices:
            need += prefix * self.frame_bytes()  # its voice's prefix, computed with its first call
        return need

    def _solve(self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
               attn: torch.Tensor) -> torch.Tensor:
        """`CausalConditionalCFM.solve_euler` (same arithmetic: fixed start noise by absolute frame, t accumulating
        dt, CFG over 2R rows) with one attention mask per row: mu, cond (R, C, Tmax), mask (R, 1, Tmax), spks (R, C),
        attn (R, 1, Tmax, Tmax) -> mel (R, C, Tmax) float32."""
        decoder = self.flow.decoder
        r, _, t_max = mu.shape
        x = decoder.start_noise(r, t_max).to(device=mu.device, dtype=mu.dtype)
        mask_in = torch.cat([mask, mask])  # (2R, 1, Tmax): rows [0, R) conditional, [R, 2R) unconditional
        mu_in = torch.cat([mu, torch.zeros_like(mu)])
        spks_in = torch.cat([spks, torch.zeros_like(spks)])
        cond_in = torch.cat([cond, torch.zeros_like(cond)])
        attn_in = torch.cat([attn, attn])  # (2R, 1, Tmax, Tmax)

        def velocity(x2: torch.Tensor, t: torch.Tensor, step: int) -> torch.Tensor:
            return decoder.estimator(x2, mask_in, mu_in, t.expand(2 * r), spks_in, cond_in, False,
                                     attn_mask=attn_in)  # (2R, C, Tmax)

        return self._euler(x, velocity).float()

    def _euler(self, x: torch.Tensor, velocity: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
               ) -> torch.Tensor:
        """The Euler steps over the cosine time grid with classifier-free guidance: x (R, ...) ->
        x after `n_timesteps` steps; velocity(x for 2R rows, t, step index from 0) -> v (2R, ...), rows [0, R)
        conditional, [R, 2R) unconditional."""
        r = x.shape[0]
        t_span = cosine_time_grid(self.n_timesteps, x.dtype, x.device)
        w = self.flow.decoder.config.inference_cfg_rate
        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            v = velocity(torch.cat([x, x]), t, step - 1)
            x = x + dt * ((1.0 + w) * v[:r] - w * v[r:])
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return x

    # ---- vocoder ----------------------------------------------------------------------------------------
    def _vocode(self, items: list[tuple[CV3StreamState, FlowCall]], mels: list[torch.Tensor]) -> list[np.ndarray]:
        """Append each row's new mel to its kept mel; the causal HiFT's new samples (`cv3.vocoder`)."""
        rows = []
        for (s, call), mel in zip(items, mels):
            new = mel.float()
            s.mel = new if s.mel is None else torch.cat([s.mel, new], dim=1)
            m = s.mel if s.speed == 1.0 else stretch(s.mel, s.speed)  # one final call (see new_stream)
            rows.append(VocoderRow(m, call.finalize, s.num_yielded))
        out = []
        for (s, _), row, chunk in zip(items, rows, vocode(self.hift, rows, self.config.vocoder_window)):
            s.num_yielded += chunk.shape[0]
            s.vocoder_frames += row.decoded_frames
            out.append(chunk.numpy())
        return out
