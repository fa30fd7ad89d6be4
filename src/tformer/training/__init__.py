"""Training: corpora, tokenizers, the optimisation loop, checkpoints."""
