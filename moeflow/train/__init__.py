"""Training: the trainer loop, data and tokenizers, checkpoints, metrics."""
