"""A phone model's labels follow its text (`SamplingConfig.follow_phones`, `vocalis.engine.label_path`): every
path the mask lets through spells the text's phones in order with pauses only where words end, the teacher's own
alignments all stay on it, and the engine draws the reference decoder's ids under it."""

from __future__ import annotations

import random

import torch

from vocalis.config import PRESETS
from vocalis.corpus.alignment import Segment, frame_labels, label_units
from vocalis.engine.config import EngineConfig
from vocalis.engine.label_path import MAX_PAUSE_FRAMES, LabelPath
from vocalis.engine.llm_engine import LLMEngine
from vocalis.frontend.phones import NUM_LABELS, PAUSE, PUNCTUATION, WORD_BOUNDARY, g2p, label_id, text_ids
from vocalis.models.speech_lm import Qwen2LM
from vocalis.reference.decode import generate

TEXT = "A cat, the dog; and seven rats."
EOS = NUM_LABELS
V = NUM_LABELS + 3


def _phones(text: str) -> list[str]:
    return [s for s in g2p(text) if s != WORD_BOUNDARY and s not in PUNCTUATION]


def _word_ends(text: str) -> set[int]:
    """Indexes of phones a word ends with."""
    ends, k = set(), -1
    for s in g2p(text):
        if s == WORD_BOUNDARY or s in PUNCTUATION:
            ends.add(k)
        else:
            k += 1
    return ends | {k}


def test_every_path_spells_the_phones_and_pauses_only_between_words() -> None:
    phones, ends = _phones(TEXT), _word_ends(TEXT)
    for seed in range(200):
        rng, path, out = random.Random(seed), LabelPath(text_ids(TEXT), EOS, V), []
        while (label := rng.choice(path.allowed(out))) != EOS:
            out.append(label)
            assert len(out) < 10_000
        units = label_units(out)
        assert [u for u in units if u != PAUSE] == phones
        k = -1
        for u in units:  # a pause comes first, or after a phone a word ends with
            if u == PAUSE:
                assert k == -1 or k in ends
            else:
                k += 1
        assert set(path.masked_ids(out)) == set(range(V)) - set(path.allowed(out))


def test_the_teachers_alignments_stay_on_the_path() -> None:
    """Labels as the corpus makes them (a pause first and last, pauses where words end, every phone >= 1 frame),
    including a pause split in two and a phone repeated across a word boundary: never masked, and eos is allowed
    after them."""
    text = "Bus stop, pop pots."
    phones, ends = _phones(text), sorted(_word_ends(text))
    segs, t = [Segment(0.2, PAUSE)], 0.2
    for k, unit in enumerate(phones):
        t += 0.08
        segs.append(Segment(round(t, 3), unit))
        if k == ends[1]:  # the comma: a pause in two segments
            segs += [Segment(round(t + 0.1, 3), PAUSE), Segment(round(t + 0.2, 3), PAUSE)]
            t += 0.2
    segs.append(Segment(round(t + 0.3, 3), PAUSE))
    labels = frame_labels(segs, round(segs[-1].end * 25))
    path = LabelPath(text_ids(text), EOS, V)
    for i, label in enumerate(labels):
        assert label in path.allowed(labels[:i]), (i, label)
    assert EOS in path.allowed(labels)


def test_the_engine_draws_the_reference_decoders_ids_on_the_path() -> None:
    config = PRESETS["tiny-phones"]
    torch.manual_seed(0)
    lm = Qwen2LM(config.llm).eval()
    engine = LLMEngine(lm, EngineConfig(block_size=4, max_num_batched_tokens=64, num_kv_blocks=512))
    texts = [TEXT, "Hello there.", "Seven rats ran."]
    reqs = [engine.make_request(text_ids(t), params=engine.sampling_params(len(text_ids(t)), config.sampling,
                                                                          seed=i))
            for i, t in enumerate(texts)]
    assert all(r.label_path is not None for r in reqs)
    got = engine.generate(reqs)  # batched together
    for i, (text, req) in enumerate(zip(texts, reqs)):
        gen = torch.Generator()
        gen.manual_seed(i)
        want = list(generate(lm, text_ids(text), sampling=config.sampling, generator=gen))
        assert got[req.request_id] == want
        # random weights keep to the path too (a run cut at max_len spells a prefix)
        spelled = [u for u in label_units(want) if u != PAUSE]
        assert spelled == _phones(text)[: len(spelled)] and spelled


def test_a_pause_ends_after_max_pause_frames() -> None:
    """A model that would pause for ever (as the built-in model did after "Client" in "Client eighteen is here
    today.", until its length bound): after MAX_PAUSE_FRAMES pause labels only the next phone may follow, and
    after the last phone eos, once min_len ids are out (eos is masked before, so the pause may go on until then)."""
    pauses = {label_id(PAUSE, False), label_id(PAUSE, True)}
    min_len = 200  # past the last phone of this always-pausing path
    path, out = LabelPath(text_ids(TEXT), EOS, V, min_len=min_len), []
    while True:  # a model that always pauses when it may, and ends only when it must
        allowed = path.allowed(out)
        paused = [i for i in (label_id(PAUSE, True), label_id(PAUSE, False)) if i in allowed]
        if paused:
            out.append(paused[0])
        elif EOS in allowed:
            break
        else:
            out.append(allowed[-1])
        assert len(out) < 1000
    assert [u for u in label_units(out) if u != PAUSE] == _phones(TEXT)
    runs, run = [], 0
    for label in out:
        run = run + 1 if label in pauses else 0
        runs.append(run)
    last_phone = max(i for i, label in enumerate(out) if label not in pauses)
    assert max(runs[: last_phone + 1]) == MAX_PAUSE_FRAMES  # every pause inside the text stops at the bound
    assert len(out) == min_len  # the final pause lasted until eos was allowed, no longer
