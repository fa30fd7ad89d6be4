"""Reading and writing HuggingFace-style folders: ``config.json`` plus ``*.safetensors`` weights,
either one ``model.safetensors`` or shards listed in ``model.safetensors.index.json``.

No ``transformers`` import: only ``json`` and ``safetensors``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tformer.io import atomic_write, atomic_write_json
from tformer.errors import CheckpointError, ConfigError

Tensor = torch.Tensor

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read_config(folder: str | Path) -> dict:
    """The folder's ``config.json`` as a dict.

    Raises:
        CheckpointError: the folder or its config.json is missing, or config.json is not JSON.
    """
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found; --from-hf needs a HuggingFace model folder "
                         f"(config.json + *.safetensors, as written by save_pretrained).")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}).") from None


def read_tensors(folder: str | Path) -> dict[str, Tensor]:
    """Every tensor of the folder, from ``model.safetensors`` or the shards of its index.

    Raises:
        CheckpointError: no safetensors weights are found (``pytorch_model.bin`` is never read:
            pickles can run code; the message says how to re-save it), the index is not JSON or
            lists no shard, a shard is missing, or a file is damaged.
    """
    folder = Path(folder)
    if (folder / INDEX).is_file():
        try:
            index = json.loads((folder / INDEX).read_text())
        except ValueError as e:
            raise CheckpointError(f"{folder / INDEX} is not valid JSON ({e}); download or save it again.") from None
        shards = sorted(set(index.get("weight_map", {}).values()))
        if not shards:
            raise CheckpointError(f"{folder / INDEX} has an empty weight_map.")
        tensors: dict[str, Tensor] = {}
        for shard in shards:
            if not (folder / shard).is_file():
                raise CheckpointError(f"shard {shard} listed in {INDEX} is missing from {folder}.")
            tensors.update(_load(folder / shard))
        return tensors
    if (folder / SINGLE).is_file():
        return _load(folder / SINGLE)
    found = sorted(folder.glob("*.safetensors"))
    if len(found) == 1:
        return _load(found[0])
    hint = " (found pytorch_model.bin: re-save it with save_pretrained(..., safe_serialization=True))" \
        if (folder / "pytorch_model.bin").exists() else ""
    raise CheckpointError(f"no {SINGLE} or {INDEX} in {folder}{hint}.")


def _load(path: Path) -> dict[str, Tensor]:
    """One safetensors file; a truncated or malformed one is refused in one sentence."""
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError for I/O)
        if isinstance(e, OSError) and e.errno is not None:
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"cannot read {path} ({first}); the file is damaged or incomplete (an interrupted "
                              f"download?); download or save it again.") from e


def eos_token_ids(folder: Path) -> list[int]:
    """An HF folder's end-of-sequence ids: ``generation_config.json``'s, else ``config.json``'s (an int or a list)."""
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((folder / name).read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if eos is not None:
            return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return []


def write_folder(folder: str | Path, config: dict, tensors: dict[str, Tensor],
                 max_shard_bytes: int | None = None) -> None:
    """Write ``config.json`` and the weights (one file, or shards plus an index when the total
    exceeds ``max_shard_bytes``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*folder.glob("model*.safetensors"), folder / INDEX]:  # an earlier export's weights
        stale.unlink(missing_ok=True)
    atomic_write_json(folder / "config.json", config)
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        atomic_write(folder / SINGLE, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        return
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        atomic_write(folder / fname, lambda tmp, shard=shard: save_file(shard, tmp, metadata={"format": "pt"}))
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write_json(folder / INDEX, index)


class TensorSource:
    """The HF tensors being converted; :meth:`take` pops one by name so that :meth:`leftover`
    can refuse any tensor nobody consumed (a weight we do not understand is never dropped silently).

    Args:
        tensors: name -> tensor.
        prefix: stripped from names that carry it (``transformer.``, ``model.``, ``bert.``).
    """

    def __init__(self, tensors: dict[str, Tensor], prefix: str = ""):
        self.tensors = {(k[len(prefix):] if prefix and k.startswith(prefix) else k): v
                        for k, v in tensors.items()}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str) -> Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint; is config.json the one "
                             f"that belongs to these weights?")
        return self.tensors.pop(name)

    def drop(self, *names: str) -> None:
        """Discard tensors known to carry nothing (buffers such as ``position_ids``)."""
        for name in names:
            self.tensors.pop(name, None)

    def take_tied(self, name: str, tied_to: Tensor) -> None:
        """Consume a tied copy (``lm_head.weight`` next to a tied embedding) if the file stores one,
        refusing it unless it really equals the matrix it is tied to."""
        if name in self.tensors and not torch.equal(self.tensors.pop(name), tied_to):
            raise CheckpointError(f"tensor {name!r} differs from the embedding it is tied to, but the config says "
                             f"tie_word_embeddings=true; fix the config or the weights.")

    def take_lm_head(self, embedding: Tensor, tied: bool) -> Tensor:
        """The LM head: the embedding itself when ``tied`` (a stored copy must equal it), else
        the file's ``lm_head.weight``."""
        if tied:
            self.take_tied("lm_head.weight", embedding)
            return embedding
        return self.take("lm_head.weight")

    def check_consumed(self) -> None:
        if self.tensors:
            names = sorted(self.tensors)
            more = f" and {len(names) - 8} more" if len(names) > 8 else ""
            raise CheckpointError(f"unexpected tensor(s) {', '.join(names[:8])}{more} in the checkpoint: "
                             f"this converter does not know what they do, so it refuses to load "
                             f"the model without them.")


def hf_get(hf: dict, *names: str, default=None):
    """The first of ``names`` present in the HF config (models rename fields), else ``default``."""
    for n in names:
        if n in hf and hf[n] is not None:
            return hf[n]
    return default


def refuse(field: str, value, why: str) -> CheckpointError:
    """The error for a config the converter does not support, naming the field."""
    return CheckpointError(f"config.json field {field}={value!r} is not supported: {why}")


def require(config, family: str, **values) -> None:
    """Refuse to export ``config`` as ``family`` unless each named field has the given value."""
    for field, want in values.items():
        have = getattr(config, field)
        if have != want:
            raise ConfigError(f"cannot export as {family}: it needs {field}={want!r}, the model has "
                             f"{field}={have!r}.")
