"""Training data: record sources, tokenizers, the token cache, chat encoding, packing and the batch sampler."""
