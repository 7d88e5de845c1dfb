"""Training data: Parquet shards (from `vocalis prepare`) -> filtered, shuffled, length-sorted, dynamically
batched and padded `Batch`es, per task.

Pipeline, per DataLoader worker: shards (shuffled per epoch, the same order on every rank) -> this rank's and
this worker's part -> rows -> `Example` (task-specific columns only; filters by length and text/frame ratio)
-> shuffle buffer -> sort buffer (by length) -> dynamic batches (a batch is cut when its longest example times
its size would pass `max_frames_in_batch`) -> padded `Batch`. Every random choice comes from a Random seeded
by (seed, epoch, rank, worker), so an epoch is reproducible; ranks and workers read disjoint data (whole
shards when there are enough, otherwise every n-th row).

Batching lengths ("frames") per task: llm = text + speech ids + 2; flow = mel frames (2 per speech token);
hift = the segment length in mel frames; tokenizer = 50 Hz mel frames (its input is the 100 Hz Whisper log-mel
of the 16 kHz audio, computed here from the stored 24 kHz audio; its CTC targets come from `target_encoder`);
labeller = the same input, its targets the stored speech ids (the phone model's 25 Hz labels, one per frame).

Legend: B batch, T mel frames, Nt text ids, Ns speech ids, N samples, 80 mel bins.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soxr
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from vocalis.config import PROMPT_SAMPLE_RATE_16K, SAMPLE_RATE, SAMPLES_PER_MEL_FRAME, TOKEN_MEL_RATIO
from vocalis.errors import InputError

log = logging.getLogger(__name__)

TASKS = ("llm", "flow", "hift", "tokenizer", "labeller", "dpo", "grpo")  # dpo, grpo: the llm, no shards
N_MELS = 80
_COLUMNS = {
    "llm": ("utt", "speaker", "text_token", "speech_token", "num_frames"),
    "flow": ("utt", "speaker", "text_token", "speech_token", "embedding", "num_frames", "mel"),
    "hift": ("utt", "text_token", "num_frames", "mel", "f0", "audio"),
    "tokenizer": ("utt", "text", "language", "text_token", "num_frames", "audio"),
    "labeller": ("utt", "text_token", "speech_token", "num_frames", "audio"),
}


@dataclass(frozen=True, slots=True)
class DataConfig:
    train: tuple[str, ...] = ()  # data.list files, prepared directories or .parquet files
    seed: int = 0
    shuffle_buffer: int = 1000  # 0 or 1: keep the shard order
    sort_buffer: int = 500  # 0 or 1: no sorting
    max_frames_in_batch: int = 2000
    min_frames: int = 25  # mel frames (50 Hz): 0.5 s
    max_frames: int = 1500  # 30 s
    min_text_tokens: int = 1
    max_text_tokens: int = 200
    min_text_per_frame: float = 0.001  # text ids per mel frame (the official 0.0005..1 per 10 ms frame)
    max_text_per_frame: float = 2.0
    segment_frames: int = 51  # hift: random crop of this many mel frames (24480 samples)
    use_speaker_embedding: bool = False  # flow: the speaker's mean x-vector instead of the utterance's
    # llm: share of examples joined to another of the same speaker (texts and speech ids back to back), as a
    # zero-shot prompt utterance precedes the text at inference; 0 = every example alone (the official recipe)
    pair_prob: float = 0.0
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int = 2

    def __post_init__(self) -> None:
        if not 0.0 <= self.pair_prob <= 1.0:
            raise ValueError(f"data.pair_prob must be in [0, 1], got {self.pair_prob}")


@dataclass(slots=True)
class Example:
    utt: str
    length: int  # batching length (see module docstring)
    text: str = ""
    speaker: str = ""
    text_token: np.ndarray | None = None  # (Nt,) int
    speech_token: np.ndarray | None = None  # (Ns,) int
    embedding: np.ndarray | None = None  # (192,) float32
    mel: np.ndarray | None = None  # (T, 80) float32
    f0: np.ndarray | None = None  # (T,) float32
    audio: np.ndarray | None = None  # (T * 480,) float32
    target: np.ndarray | None = None  # (U,) CTC symbol ids (tokenizer)


@dataclass(slots=True)
class Batch:
    """Padded tensors; fields a task does not use are None. Padding is 0 and lengths say what is real."""

    utts: tuple[str, ...]
    num_frames: int  # sum of the examples' batching lengths (frames/s)
    text: tuple[str, ...] = ()
    text_token: torch.Tensor | None = None  # (B, Nt) int64
    text_token_len: torch.Tensor | None = None  # (B,)
    speech_token: torch.Tensor | None = None  # (B, Ns) int64
    speech_token_len: torch.Tensor | None = None  # (B,)
    mel: torch.Tensor | None = None  # (B, T, 80)
    mel_len: torch.Tensor | None = None  # (B,)
    embedding: torch.Tensor | None = None  # (B, 192)
    f0: torch.Tensor | None = None  # (B, T)
    audio: torch.Tensor | None = None  # (B, N)
    audio_len: torch.Tensor | None = None  # (B,)
    target: torch.Tensor | None = None  # (B, U) int64 CTC targets (tokenizer)
    target_len: torch.Tensor | None = None  # (B,)

    @property
    def size(self) -> int:
        return len(self.utts)

    def _map(self, fn) -> Batch:
        return dataclasses.replace(
            self, **{f.name: fn(getattr(self, f.name)) for f in dataclasses.fields(self)
                     if isinstance(getattr(self, f.name), torch.Tensor)}
        )

    def to(self, device: torch.device | str) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> Batch:  # called by DataLoader(pin_memory=True)
        return self._map(lambda t: t.pin_memory())


def resolve_shards(sources: tuple[str, ...] | list[str]) -> list[Path]:
    """data.list files, prepared directories (their data.list) and .parquet files -> shard paths."""
    shards: list[Path] = []
    for src in sources:
        p = Path(src)
        if p.is_dir():
            p = p / "data.list"
        if p.suffix == ".parquet" and p.is_file():
            shards.append(p)
        elif p.is_file():
            shards += [Path(line.strip()) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
        else:
            raise InputError(f"training data not found: {src} (give a data.list, a prepared directory or a .parquet)")
    missing = [str(s) for s in shards if not s.is_file()]
    if missing:
        raise InputError(f"{len(missing)} shards listed but missing, e.g. {missing[0]}")
    if not shards:
        raise InputError(f"no shards in {list(sources)}")
    return shards


def _speaker_table(shards: list[Path]) -> dict[str, np.ndarray]:
    table: dict[str, np.ndarray] = {}
    for d in {s.parent.parent for s in shards}:
        f = d / "spk2embedding.json"
        if f.is_file():
            table.update({k: np.asarray(v, dtype=np.float32) for k, v in json.loads(f.read_text("utf-8")).items()})
    return table


class ShardDataset(IterableDataset):
    """Streams `Batch`es for one task; call `set_epoch` before each epoch."""

    def __init__(
        self,
        shards: list[Path],
        config: DataConfig,
        task: str,
        rank: int = 0,
        world_size: int = 1,
        target_encoder: Callable[[str, str], list[int]] | None = None,
    ) -> None:
        if task not in TASKS:
            raise InputError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
        self.shards = list(shards)
        self.config = config
        self.task = task
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.target_encoder = target_encoder  # tokenizer: (text, language) -> CTC symbol ids; must pickle
        if task == "tokenizer" and target_encoder is None:
            raise InputError("the tokenizer task needs a target_encoder (text -> CTC symbol ids)")
        self.speakers = _speaker_table(self.shards) if task == "flow" and config.use_speaker_embedding else {}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    # ---- partition and read ----------------------------------------------------------------------------
    def _slot(self) -> tuple[int, int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.rank * workers + worker, self.world_size * workers

    def _rows(self) -> Iterator[dict]:
        import pyarrow.parquet as pq

        slot, slots = self._slot()
        order = list(self.shards)
        random.Random(f"{self.config.seed}-{self.epoch}-shards").shuffle(order)
        by_shard = len(order) >= slots
        mine = order[slot::slots] if by_shard else order
        row_index = 0
        for shard in mine:
            pf = pq.ParquetFile(shard)
            for rb in pf.iter_batches(batch_size=64, columns=list(_COLUMNS[self.task])):
                cols = {name: rb.column(name) for name in rb.schema.names}
                for i in range(rb.num_rows):
                    row_index += 1
                    if not by_shard and (row_index - 1) % slots != slot:
                        continue
                    yield _row(cols, i)

    # ---- examples --------------------------------------------------------------------------------------
    def _keep(self, num_frames: int, num_text: int) -> bool:
        c = self.config
        return (
            c.min_frames <= num_frames <= c.max_frames
            and c.min_text_tokens <= num_text <= c.max_text_tokens
            and c.min_text_per_frame <= num_text / max(num_frames, 1) <= c.max_text_per_frame
        )

    def _example(self, row: dict, rng: random.Random) -> Example | None:
        t = row["num_frames"]
        text_token = row["text_token"]
        if not self._keep(t, len(text_token)):
            return None
        utt = row["utt"]
        if self.task == "llm":
            speech = row["speech_token"]
            if len(speech) == 0:
                return None
            return Example(utt, len(text_token) + len(speech) + 2, text_token=text_token, speech_token=speech,
                           speaker=row["speaker"])
        if self.task == "tokenizer":
            return self._tokenizer_example(row)
        if self.task == "labeller":
            mel = _whisper_mel(row["audio"])
            if mel is None:
                raise InputError(f"utterance {utt} has no audio: the labeller reads it (prepare without --no-audio; "
                                 "phone labels: attach_labels(keep_audio=True))")
            if len(row["speech_token"]) == 0:
                return None
            return Example(utt, t, mel=mel, speech_token=row["speech_token"])
        mel = row["mel"].reshape(t, N_MELS)
        if self.task == "flow":
            n = min(t // TOKEN_MEL_RATIO, len(row["speech_token"]))
            if n == 0:
                return None
            emb = self.speakers.get(row["speaker"], row["embedding"]) if self.speakers else row["embedding"]
            return Example(utt, TOKEN_MEL_RATIO * n, speech_token=row["speech_token"][:n],
                           mel=mel[: TOKEN_MEL_RATIO * n], embedding=emb)
        assert self.task == "hift"
        seg = self.config.segment_frames
        audio = np.frombuffer(row["audio"], dtype="<i2").astype(np.float32) / 32767.0
        if len(audio) < t * SAMPLES_PER_MEL_FRAME:
            return None  # prepared without audio (keep_audio=False)
        start = rng.randrange(t - seg + 1) if t > seg else 0
        mel, f0 = mel[start : start + seg], row["f0"][start : start + seg]
        audio = audio[start * SAMPLES_PER_MEL_FRAME : (start + seg) * SAMPLES_PER_MEL_FRAME]
        if len(mel) < seg:  # short utterance: pad to the segment (as the official `truncate`)
            pad = seg - len(mel)
            mel = np.pad(mel, ((0, pad), (0, 0)), constant_values=float(mel.min()))
            f0 = np.pad(f0, (0, pad))
            audio = np.pad(audio, (0, seg * SAMPLES_PER_MEL_FRAME - len(audio)))
        return Example(utt, seg, mel=mel, f0=f0, audio=audio)

    def _tokenizer_example(self, row: dict) -> Example | None:
        assert self.target_encoder is not None
        target = self.target_encoder(row["text"], row["language"])
        mel = _whisper_mel(row["audio"])
        if not target or mel is None:
            return None
        return Example(row["utt"], row["num_frames"], text=row["text"], mel=mel,
                       target=np.asarray(target, dtype=np.int64))

    # ---- iteration -------------------------------------------------------------------------------------
    def examples(self) -> Iterator[Example]:
        """Filtered examples after the shuffle and sort buffers (this rank's and worker's part)."""
        c = self.config
        slot, _ = self._slot()
        rng = random.Random(f"{c.seed}-{self.epoch}-{slot}")
        stream = (e for e in (self._example(r, rng) for r in self._rows()) if e is not None)
        if c.shuffle_buffer > 1:
            stream = _shuffle(stream, c.shuffle_buffer, rng)
        if self.task == "llm" and c.pair_prob > 0:
            stream = _pairs(stream, c.pair_prob, rng)
        if c.sort_buffer > 1:
            stream = _sort(stream, c.sort_buffer)
        return stream

    def __iter__(self) -> Iterator[Batch]:
        for group in _dynamic_batches(self.examples(), self.config.max_frames_in_batch):
            yield collate(group, self.task)


def _whisper_mel(audio: bytes) -> np.ndarray | None:
    """Stored 24 kHz int16 audio -> the 100 Hz Whisper log-mel of its 16 kHz resampling (T100, 128); None: no audio."""
    from vocalis.frontend.audio import whisper_log_mel

    pcm = np.frombuffer(audio, dtype="<i2")
    if len(pcm) == 0:
        return None
    wav16 = soxr.resample(pcm.astype(np.float32) / 32767.0, SAMPLE_RATE, PROMPT_SAMPLE_RATE_16K)
    return whisper_log_mel(wav16).numpy().T


def _row(cols: dict, i: int) -> dict:
    """Row i of a record batch: lists as numpy views, scalars as Python values."""
    import pyarrow as pa

    out = {}
    for name, col in cols.items():
        if isinstance(col, pa.ListArray):
            offsets = col.offsets
            lo, hi = offsets[i].as_py(), offsets[i + 1].as_py()
            out[name] = col.values.slice(lo, hi - lo).to_numpy(zero_copy_only=False)
        else:
            out[name] = col[i].as_py()
    return out


def _shuffle(stream: Iterator[Example], size: int, rng: random.Random) -> Iterator[Example]:
    buf: list[Example] = []
    for e in stream:
        buf.append(e)
        if len(buf) >= size:
            j = rng.randrange(len(buf))
            buf[j], buf[-1] = buf[-1], buf[j]
            yield buf.pop()
    rng.shuffle(buf)
    yield from buf


def _pairs(stream: Iterator[Example], prob: float, rng: random.Random) -> Iterator[Example]:
    """llm: each example, with probability `prob`, waits for the next chosen one of its speaker and goes out joined
    to it (the first as the prompt utterance); a partner never found goes out alone at the end."""
    waiting: dict[str, Example] = {}
    for e in stream:
        if rng.random() >= prob:
            yield e
            continue
        first = waiting.pop(e.speaker, None)
        if first is None:
            waiting[e.speaker] = e
            continue
        assert first.text_token is not None and first.speech_token is not None
        assert e.text_token is not None and e.speech_token is not None
        yield Example(f"{first.utt}+{e.utt}", first.length + e.length - 2, speaker=e.speaker,
                      text_token=np.concatenate([first.text_token, e.text_token]),
                      speech_token=np.concatenate([first.speech_token, e.speech_token]))
    yield from waiting.values()


def _sort(stream: Iterator[Example], size: int) -> Iterator[Example]:
    buf: list[Example] = []
    for e in stream:
        buf.append(e)
        if len(buf) >= size:
            buf.sort(key=lambda x: x.length)
            yield from buf
            buf = []
    buf.sort(key=lambda x: x.length)
    yield from buf


def _dynamic_batches(stream: Iterator[Example], max_frames: int) -> Iterator[list[Example]]:
    group: list[Example] = []
    longest = 0
    for e in stream:
        new_longest = max(longest, e.length)
        if group and new_longest * (len(group) + 1) > max_frames:
            yield group
            group, new_longest = [], e.length
        group.append(e)
        longest = new_longest
    if group:
        yield group


def _pad(arrays: list[np.ndarray], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(a) for a in arrays], dtype=torch.int64)
    out = torch.zeros((len(arrays), int(lengths.max()), *arrays[0].shape[1:]), dtype=dtype)
    for i, a in enumerate(arrays):
        out[i, : len(a)] = torch.tensor(a, dtype=dtype)  # copies: Arrow buffers are read-only
    return out, lengths


def collate(examples: list[Example], task: str) -> Batch:
    """Pad a group of examples into one `Batch` (rows in the group's order)."""
    b = Batch(tuple(e.utt for e in examples), sum(e.length for e in examples), tuple(e.text for e in examples))
    first = examples[0]
    if first.text_token is not None:
        b.text_token, b.text_token_len = _pad([e.text_token for e in examples], torch.int64)
    if first.speech_token is not None:
        b.speech_token, b.speech_token_len = _pad([e.speech_token for e in examples], torch.int64)
    if first.mel is not None:
        b.mel, b.mel_len = _pad([e.mel for e in examples], torch.float32)
    if first.embedding is not None:
        b.embedding = torch.from_numpy(np.stack([e.embedding for e in examples])).float()
    if first.f0 is not None:
        b.f0, _ = _pad([e.f0 for e in examples], torch.float32)
    if first.audio is not None:
        b.audio, b.audio_len = _pad([e.audio for e in examples], torch.float32)
    if first.target is not None:
        b.target, b.target_len = _pad([e.target for e in examples], torch.int64)
    if task == "flow":  # the flow needs exactly 2 mel frames per token, padding included
        assert b.mel is not None and b.speech_token is not None
        b.mel = b.mel[:, : TOKEN_MEL_RATIO * b.speech_token.shape[1]]
    return b


def _identity(x: Batch) -> Batch:
    return x


def make_loader(dataset: ShardDataset) -> DataLoader:
    c = dataset.config
    kwargs = {"prefetch_factor": c.prefetch_factor} if c.num_workers > 0 else {}
    # A private generator: creating an iterator would otherwise draw from the global torch RNG (the workers'
    # base seed), shifting the dropout stream of a resumed run against an uninterrupted one.
    return DataLoader(dataset, batch_size=None, collate_fn=_identity, num_workers=c.num_workers,
                      pin_memory=c.pin_memory, generator=torch.Generator().manual_seed(c.seed), **kwargs)
