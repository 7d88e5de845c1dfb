"""Training: data preparation, datasets, trainers and checkpoints. Never imported by the inference path."""
