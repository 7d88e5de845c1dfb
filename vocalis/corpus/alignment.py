"""The teacher's own alignment: festival segments -> 25 Hz phone-state labels (the built-in model's speech tokens).

Festival writes, per utterance, every segment of its `Segment` relation with its end time, name and syllable
stress (`SEGS_SCHEME`'s `vocalis_segs`, the `utt.save.segs` list plus stress). For `cmu_us_slt_arctic_hts` the
ends fall on 5 ms steps (rounded here to undo festival's float printing). `frame_labels` maps them onto 40 ms
frames: segment i owns frames [b_(i-1), b_i) with b_i the frame nearest its end, pushed so that every segment
keeps at least one frame (forward) and the last ends on the last frame (backward); its first frame is labelled
(unit, begin), the others (unit, inside): `vocalis.frontend.phones.label_id`.

Legend: T frames at 25 Hz (T = floor(25 * seconds)).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from vocalis.frontend.phones import PAUSE, UNIT_IDS, VOWELS, label_id, label_unit

FRAME_RATE = 25  # labels per second: the CosyVoice 2 speech-token rate
STEP_S = 0.005  # festival HTS segment ends fall on 5 ms steps

# (vocalis_segs UTT PATH): one line per segment: end name stress
SEGS_SCHEME = """(define (vocalis_segs utt path)
  (let ((fd (fopen path "w")))
    (mapcar (lambda (s) (format fd "%s %s %s\\n" (item.feat s "end") (item.name s)
                                (item.feat s "R:SylStructure.parent.stress")))
            (utt.relation.items utt 'Segment))
    (fclose fd)))"""


class Segment(NamedTuple):
    end: float  # seconds, on the 5 ms grid
    unit: str  # a vocalis.frontend.phones.UNITS symbol: "pau", a consonant, or a vowel with its stress ("ow1")


def read_segments(path: str | Path) -> list[Segment]:
    """A `vocalis_segs` file -> segments; ValueError naming the line for a phone outside the phone set."""
    out: list[Segment] = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        end, name, stress = line.split()
        unit = f"{name}{min(int(float(stress)), 1)}" if name in VOWELS else name
        if unit not in UNIT_IDS:
            raise ValueError(f"{path}:{lineno}: phone {name!r} is not in the built-in phone set")
        out.append(Segment(round(round(float(end) / STEP_S) * STEP_S, 3), unit))
    return out


def num_frames(seconds: float) -> int:
    return int(seconds * FRAME_RATE + 1e-6)


def frame_bounds(segments: list[Segment], frames: int) -> list[int]:
    """End frame (exclusive) of every segment: nearest frame to its end, >= 1 frame each, the last = `frames`."""
    n = len(segments)
    if n == 0 or n > frames:
        raise ValueError(f"{n} segments cannot each get a frame of {frames}")
    bounds: list[int] = []
    for i, seg in enumerate(segments):
        b = max(round(seg.end * FRAME_RATE), (bounds[-1] if bounds else 0) + 1)
        bounds.append(b)
    bounds[-1] = frames
    for i in range(n - 2, -1, -1):
        bounds[i] = min(bounds[i], bounds[i + 1] - 1)
    return bounds


def frame_labels(segments: list[Segment], frames: int) -> list[int]:
    """(T,) label ids: per segment, a begin frame then inside frames."""
    out: list[int] = []
    start = 0
    for seg, end in zip(segments, frame_bounds(segments, frames)):
        out += [label_id(seg.unit, False)] + [label_id(seg.unit, True)] * (end - start - 1)
        start = end
    return out


def label_units(labels: list[int]) -> list[str]:
    """The unit sequence that `labels` spells (one entry per begin frame): the alignment's segment order."""
    return [unit for unit, inside in map(label_unit, labels) if not inside]


def reconcile(predicted: list[str], segments: list[Segment]) -> list[Segment] | None:
    """`segments` spelled in the text frontend's phones `predicted` (pauses excluded), or None where they differ by
    more than a voice's own realisation of the same phones. festival's diphone voices (kal, ked) apply post-lexical
    rules that the lexicon does not: unstressed and function-word vowels reduced to schwa (`ax`), and ked's r-coloured
    vowel split into `er` + `r`. A label means the text's phone, however a voice says it, so that one LLM maps the
    same text to the same labels for every voice: an `ax` where the text has another vowel takes the text's vowel
    (its stress too), and an `r` after `er` that the text lacks joins the `er` (its frames become the vowel's)."""
    out: list[Segment] = []
    k = 0
    for seg in segments:
        if seg.unit == PAUSE:
            out.append(seg)
            continue
        if seg.unit == "r" and out and out[-1].unit[:-1] == "er" and (k == len(predicted) or predicted[k] != "r"):
            out[-1] = out[-1]._replace(end=seg.end)
            continue
        if k == len(predicted):
            return None
        want = predicted[k]
        if seg.unit != want:
            if not (seg.unit[:-1] == "ax" and want[:-1] in VOWELS):
                return None
            seg = seg._replace(unit=want)
        out.append(seg)
        k += 1
    return out if k == len(predicted) else None
