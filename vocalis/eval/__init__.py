"""Evaluation toolkit (`vocalis eval`): WER/CER with an offline or plugged-in ASR, speaker similarity
(resemblyzer, CAM++), duration statistics and RTF, reported as markdown, JSON and PNG plots.

Needs the `eval` extra: `pip install 'vocalis[eval]'` and `pip install --no-deps resemblyzer webrtcvad-wheels`.
"""

from vocalis.eval.asr import PocketsphinxTranscriber, Transcriber, load_transcriber
from vocalis.eval.text_norm import normalize
from vocalis.eval.wer import EditCounts, cer, edit_counts, wer

__all__ = ["EditCounts", "PocketsphinxTranscriber", "Transcriber", "cer", "edit_counts", "load_transcriber",
           "normalize", "wer"]
