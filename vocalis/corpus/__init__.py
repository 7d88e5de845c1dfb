"""Synthetic training corpus for the built-in model: template text + Debian festival / espeak-ng teacher voices."""
