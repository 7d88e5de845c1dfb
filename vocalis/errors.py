"""Errors a user can cause and fix. The CLI prints them as one line and exits 2; the server maps them to 4xx."""

from __future__ import annotations


class VocalisError(Exception):
    """Base class: the message alone must tell the user what went wrong and what to do."""


class InputError(VocalisError):
    """Bad text, bad parameters or an unsupported request."""


class AudioError(InputError):
    """A prompt or source audio file that cannot be used (missing, corrupt, silent, too short or long)."""


class ModelLoadError(VocalisError):
    """A model directory or checkpoint that is missing files or has mismatched tensors."""
