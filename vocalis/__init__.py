"""Vocalis: fast, full-stack CosyVoice 2-compatible speech generation."""
