"""Dataset inference: manifests in, audio files out, on the engine."""
