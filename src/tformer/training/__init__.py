"""Training: the one loop (:mod:`~tformer.training.loop`) and what it runs on: tasks (``tasks/``),
corpora (``data``), optimisers and schedules, recipes, run folders and resume, ranks (DDP / FSDP),
fine-tuning and LoRA. Tokenizers are :mod:`tformer.tokenizers`; model save / load is
:mod:`tformer.checkpoint`. Nothing is re-exported: import from the module."""
