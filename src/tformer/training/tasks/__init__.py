"""What the training loop runs: the ``Task`` protocol (``base``) and the built-in tasks (language
modelling, fine-tuning, ListOps, Mamba's synthetic tasks)."""
