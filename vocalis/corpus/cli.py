"""`vocalis corpus OUT`: build (or resume building) the synthetic training corpus. Importing this is cheap."""

from __future__ import annotations

import argparse
import json


def _corpus(args: argparse.Namespace) -> int:
    if args.voice is not None:  # the built-in model's phone corpus: festival voices with their alignment
        from vocalis.corpus.phone_corpus import PhoneCorpusConfig
        from vocalis.corpus.phone_corpus import build as build_phones

        config = PhoneCorpusConfig(args.out, utterances=args.utterances, voices=tuple(dict.fromkeys(args.voice)),
                                   seed=args.seed, workers=args.workers)
        print(json.dumps(build_phones(config), indent=1))
        return 0
    from vocalis.corpus.build import CorpusConfig, build

    summary = build(CorpusConfig(args.out, hours=args.hours, workers=args.workers, seed=args.seed,
                                 heldout=args.heldout))
    failed = summary.pop("failed")
    print(json.dumps(summary, indent=1, ensure_ascii=False))
    for utt, reason in sorted(failed.items()):  # type: ignore[union-attr]
        print(f"failed {utt}: {reason}")
    return 0


def add_corpus_command(sub: argparse._SubParsersAction) -> None:
    cp = sub.add_parser("corpus", help="synthesise the multilingual training corpus (festival + espeak-ng); resumable")
    cp.add_argument("out", help="output folder (wavs/, manifest.jsonl, heldout_en.jsonl, corpus.json)")
    cp.add_argument("--hours", type=float, default=2.0, help="planned size (about 3 s per utterance)")
    cp.add_argument("--workers", type=int, default=2, help="parallel synthesis processes")
    cp.add_argument("--seed", type=int, default=0)
    cp.add_argument("--heldout", type=int, default=60, help="English sentences held out for measurement")
    cp.add_argument("--voice", nargs="+", choices=("slt", "kal", "ked"),
                    help="the built-in model's phone corpus: WordNet, fortunes and template text spoken by these "
                    "festival voices, with 25 Hz labels from their alignment")
    cp.add_argument("--utterances", type=int, default=4000, help="with --voice: sentences to speak, per voice")
    cp.set_defaults(func=_corpus)
