"""LoRA adapters of the speech LM at inference: the adapter file format, merging into the base weights, and the
batched maths for serving several adapters in one batch. Training them lives in `vocalis.train.lora`."""
