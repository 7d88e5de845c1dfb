"""Prepared shards -> shards of the phone-based built-in model: text ids = phones, speech ids = 25 Hz labels.

`vocalis prepare` computes mel, F0 and audio from a phone corpus (`vocalis corpus --voice slt`); its text ids are
BPE and its speech ids empty. `attach_labels` rewrites each shard with `text_token` = `labels.jsonl`'s `text_ids`
(`vocalis.frontend.phones`) and `speech_token` = its `labels` (the teacher's alignment), dropping rows without
labels or with fewer than 2 mel frames per label, and writes a `data.list` for `vocalis train flow|llm`. Audio
is dropped unless `keep_audio` (the flow and LLM do not read it). With `embedding_dim`, x-vectors prepared without
a speaker encoder (zeros) become zeros of that size, the flow's (the built-in model's is resemblyzer-sized).

    python -m vocalis.train.phone_labels PREPARED LABELS_JSONL OUT
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from vocalis.config import TOKEN_MEL_RATIO
from vocalis.errors import InputError
from vocalis.train.data import resolve_shards


def read_labels(path: Path) -> dict[str, dict[str, list[int]]]:
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            out[row["utt"]] = {"text_ids": row["text_ids"], "labels": row["labels"]}
    return out


def attach_labels(prepared: Path, labels_jsonl: Path, out: Path, keep_audio: bool = False,
                  embedding_dim: int | None = None) -> dict[str, int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    labels = read_labels(labels_jsonl)
    (out / "shards").mkdir(parents=True, exist_ok=True)
    shards, kept, dropped = [], 0, 0
    for shard in resolve_shards([str(prepared)]):
        table = pq.read_table(shard)
        rows = []
        for row in table.to_pylist():
            lab = labels.get(row["utt"])
            if lab is None or not lab["labels"] or row["num_frames"] < TOKEN_MEL_RATIO * len(lab["labels"]):
                dropped += 1
                continue
            row["text_token"], row["speech_token"] = lab["text_ids"], lab["labels"]
            if embedding_dim is not None and len(row["embedding"]) != embedding_dim:
                if any(row["embedding"]):
                    raise InputError(f"{shard}: {row['utt']} has a {len(row['embedding'])}-d speaker embedding, "
                                     f"not {embedding_dim}-d: prepare with the model's own speaker encoder")
                row["embedding"] = [0.0] * embedding_dim
            if not keep_audio:
                row["audio"] = b""
            rows.append(row)
        if not rows:
            continue
        kept += len(rows)
        dest = out / "shards" / shard.name
        tmp = dest.with_name(dest.name + ".tmp")
        pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), tmp, row_group_size=64, compression="zstd")
        os.replace(tmp, dest)
        shards.append(str(dest.resolve()))
    if not shards:
        raise InputError(f"no utterance of {prepared} has labels in {labels_jsonl}")
    (out / "data.list").write_text("\n".join(shards) + "\n", encoding="utf-8")
    summary = {"utterances": kept, "dropped": dropped, "shards": len(shards)}
    if embedding_dim is not None:
        summary["embedding_dim"] = embedding_dim
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return summary


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prepared", type=Path)
    ap.add_argument("labels", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--keep-audio", action="store_true")
    a = ap.parse_args()
    print(json.dumps(attach_labels(a.prepared, a.labels, a.out, a.keep_audio), indent=1))
