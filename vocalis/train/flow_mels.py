"""Labelled shards with audio -> the same shards with the flow's own mel: data to tune a vocoder to its flow.

A vocoder trained on the teacher's mel meets a different input at inference: the flow's mel, smoother and with
its own small errors. Here each utterance's mel is replaced by what the flow makes of its true 25 Hz labels (no
prompt, the zero x-vector: as the ladder's L2 row runs it, on the flow's fixed start noise, so inference sees the
same kind of mel), while its F0 and 24 kHz audio stay the teacher's, cut to the flow's 2 frames per label. The
alignment is the teacher's own, so the flow's frame t and the teacher's audio at frame t are the same sound.
`vocalis train hift --data OUT` then tunes the vocoder on (flow mel -> teacher audio).

A flow trained on several voices takes its voice from its in-context prompt, so with `prompts` (speaker -> a prompt
utterance of that voice: its labels and mel) each utterance is made continuing its own speaker's prompt, as a saved
voice runs at inference.

    python -m vocalis.train.flow_mels PREP_LABELS_AUDIO FLOW_WEIGHTS OUT
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from vocalis.config import SAMPLES_PER_MEL_FRAME, TOKEN_MEL_RATIO
from vocalis.errors import InputError
from vocalis.train.data import N_MELS, resolve_shards


def labels_to_mel(flow: nn.Module, labels: list[int], prompt: tuple[list[int], torch.Tensor] | None = None
                  ) -> torch.Tensor:
    """25 Hz labels -> the flow's mel (T, 80), T = 2 len(labels): zero x-vector, whole utterance, unprompted or
    continuing `prompt` (its labels and its (2 len(labels), 80) mel)."""
    dev = flow.input_embedding.weight.device
    token = torch.tensor([labels], dtype=torch.int64, device=dev)
    p_labels, p_mel = prompt if prompt is not None else ([], torch.zeros(0, N_MELS))
    p_token = torch.tensor([p_labels], dtype=torch.int64, device=dev).reshape(1, -1)
    with torch.inference_mode():
        mel = flow.inference(token, torch.tensor([len(labels)], device=dev), p_token,
                             torch.tensor([len(p_labels)], device=dev), p_mel.unsqueeze(0).to(dev),
                             torch.tensor([p_mel.shape[0]], device=dev),
                             torch.zeros(1, flow.config.spk_embed_dim, device=dev),
                             streaming=False, finalize=True)  # (1, 80, 2 len(labels))
    return mel[0].transpose(0, 1).float().cpu().contiguous()


def flow_mel_shards(prepared: Path, flow: nn.Module, out: Path,
                    prompts: dict[str, tuple[list[int], torch.Tensor]] | None = None,
                    shards_per_speaker: int | None = None) -> dict[str, int]:
    """Rewrite every shard of `prepared` (labelled, with audio) into out/shards with the flow's mel, each utterance
    continuing its speaker's prompt where `prompts` has one; resumable (a finished shard is kept);
    `shards_per_speaker`: only the first that many shards of each speaker (a shard counts for its first row's; a
    tuning set, when the flow's time per utterance is the cost). Writes out/data.list and out/summary.json. -> the summary."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (out / "shards").mkdir(parents=True, exist_ok=True)
    shards, kept, dropped, taken = [], 0, 0, {}
    for shard in resolve_shards([str(prepared)]):
        if shards_per_speaker is not None:
            speaker = pq.read_table(shard, columns=["speaker"]).column(0)[0].as_py()
            taken[speaker] = taken.get(speaker, 0) + 1
            if taken[speaker] > shards_per_speaker:
                continue
        dest = out / "shards" / shard.name
        if dest.is_file():
            shards.append(str(dest.resolve()))
            kept += pq.read_metadata(dest).num_rows
            continue
        table = pq.read_table(shard)
        rows, start = [], time.monotonic()
        for row in table.to_pylist():
            labels = row["speech_token"]
            frames = TOKEN_MEL_RATIO * len(labels)
            if not labels or not row["audio"] or row["num_frames"] < frames:
                dropped += 1
                continue
            mel = labels_to_mel(flow, labels, (prompts or {}).get(row["speaker"]))  # (frames, 80)
            row["mel"] = mel.reshape(-1).tolist()
            row["f0"] = row["f0"][:frames]
            row["audio"] = row["audio"][: 2 * frames * SAMPLES_PER_MEL_FRAME]  # int16: 2 bytes a sample
            row["num_frames"] = frames
            rows.append(row)
        if not rows:
            continue
        kept += len(rows)
        tmp = dest.with_name(dest.name + ".tmp")
        pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), tmp, row_group_size=64, compression="zstd")
        os.replace(tmp, dest)
        shards.append(str(dest.resolve()))
        print(f"flow mels: {shard.name}: {len(rows)} utterances in {time.monotonic() - start:.0f} s", flush=True)
    if not shards:
        raise InputError(f"no utterance of {prepared} has labels and audio (attach_labels(keep_audio=True))")
    (out / "data.list").write_text("\n".join(shards) + "\n", encoding="utf-8")
    summary = {"utterances": kept, "dropped": dropped, "shards": len(shards)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return summary


def load_phone_flow(weights: Path, device: str = "cpu") -> nn.Module:
    """The builtin-phones preset's flow with `weights` (fp16 or fp32 safetensors), in eval mode on `device`."""
    from safetensors.torch import load_file

    from vocalis.checkpoint import load_strict
    from vocalis.config import PRESETS
    from vocalis.models.flow.flow import CausalMaskedDiffWithXvec

    flow = CausalMaskedDiffWithXvec(PRESETS["builtin-phones"].flow)
    load_strict(flow, {k: v.float() for k, v in load_file(str(weights)).items()}, str(weights))
    return flow.to(device).eval()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prepared", type=Path, help="labelled shards with audio (RUN/prep_labels_audio)")
    ap.add_argument("flow", type=Path, help="the flow's weights (.safetensors)")
    ap.add_argument("out", type=Path)
    a = ap.parse_args()
    print(json.dumps(flow_mel_shards(a.prepared, load_phone_flow(a.flow), a.out), indent=1))
