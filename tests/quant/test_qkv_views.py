"""A GGUF's q, k and v kept as blocks stay views of the file (issue 47's memory item): no joined copy of their
bytes is made at the open or kept beside the tiles, and the logits are those of one joined matrix, bit for bit.

Random-weight Qwen2 files (q, k and v apart in the file, no row permutation), every matrix in one format
(Q8_0, Q4_0, Q4_1: tiles; Q6_K: the file layout) or q, k and v in two (Q4_0 + Q8_0 tiles, Q4_K + Q6_K rows).
Q8_0 / Q4_0 / Q4_1 are gguf-py's quantiser; the K-quant matrices are random bytes with finite fp16 scales
(gguf-py has no K-quant quantiser; tformer's dequantisation is checked against gguf's in test_kquants.py).

- each layer's q, k and v are views of the mapped file (``pages.mapped``): a JoinedLinear where they share a
  format, a StackedLinear of BlockLinears where they do not; a tiled JoinedLinear holds no joined copy after a
  prompt and decode steps on either path, a K-quant one makes its copy once (and the file's pages go back);
- the logits (a prompt, then decode steps; the whole-layer call and the module path) equal, bit for bit, those of
  the same model whose qkv is one BlockLinear over a joined copy of the rows (what the import made before);
- a Llama file (tformer's own Q8_0 export): q and k are un-permuted copies (RoPE's row order), v the file's; the
  file's pages the copies were read from are handed back at the open (``/proc/self/pagemap``'s present bits).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the optional extra 'gguf' is not installed")
pytest.importorskip("transformers")

from kquant_files import qwen2, write_gguf  # noqa: E402
from tformer.fused import choose  # noqa: E402
from tformer.generation.step import decode_step, prefill  # noqa: E402
from tformer.inference import open_model  # noqa: E402
from tformer.quant import pages, qgemv  # noqa: E402
from tformer.quant.block_linear import BlockLinear, JoinedLinear, StackedLinear  # noqa: E402

T = gguf.GGMLQuantizationType
SHAPE = dict(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, tie_word_embeddings=False)
KQUANT_SCALES = {T.Q4_K: (144, slice(0, 4)), T.Q6_K: (210, slice(208, 210))}   # block bytes, its fp16 factors
# file -> (type of attn_q / attn_k, of attn_v, of every other matrix)
FILES = {"q8_0": (T.Q8_0, T.Q8_0, T.Q8_0), "q4_0": (T.Q4_0, T.Q4_0, T.Q4_0), "q4_1": (T.Q4_1, T.Q4_1, T.Q4_1),
         "q6_k": (T.Q6_K, T.Q6_K, T.Q6_K), "q4_0+q8_0": (T.Q4_0, T.Q8_0, T.Q4_0),
         "q4_k+q6_k": (T.Q4_K, T.Q6_K, T.Q4_K)}


def encoder(kinds, rng):
    def encode(name: str, a: np.ndarray):
        kind = kinds[0] if ".attn_q." in name or ".attn_k." in name else kinds[1] if ".attn_v." in name else kinds[2]
        if kind not in KQUANT_SCALES:
            return gguf.quants.quantize(a, kind), kind
        size, scales = KQUANT_SCALES[kind]
        b = rng.integers(0, 256, (a.shape[0], a.shape[1] // 256, size), dtype=np.uint8)
        n = scales.stop - scales.start
        b[..., scales] = (rng.uniform(0.002, 0.02, b.shape[:2] + (n // 2,)).astype(np.float16)).view(np.uint8)
        return b.reshape(a.shape[0], -1), kind
    return encode


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder, hf = tmp_path_factory.mktemp("qkv_views"), qwen2(seed=1, **SHAPE)
    return {k: write_gguf(hf, folder / f"{k}.gguf", encoder(kinds, np.random.default_rng(2)))
            for k, kinds in FILES.items()}


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    import transformers
    from tformer.interop.gguf import save_gguf
    from tformer.interop.hf import load_hf
    folder = tmp_path_factory.mktemp("qkv_llama")
    torch.manual_seed(3)
    shape = {k: v for k, v in SHAPE.items() if k != "tie_word_embeddings"}
    transformers.LlamaForCausalLM(transformers.LlamaConfig(max_position_embeddings=256, **shape)).save_pretrained(folder)
    save_gguf(load_hf(folder), folder / "llama.gguf", "q8_0")
    return folder / "llama.gguf"


def present_pages(address: int, nbytes: int) -> int:
    """Whole pages of ``[address, address + nbytes)`` present in this process (``/proc/self/pagemap``, bit 63)."""
    import mmap
    page = mmap.PAGESIZE
    first, last = -(-address // page), (address + nbytes) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        words = np.frombuffer(f.read((last - first) * 8), dtype=np.uint64)
    return int(((words >> np.uint64(63)) & np.uint64(1)).sum())


def joined_copy(model):
    """``model`` with every layer's qkv one BlockLinear over a joined copy of its rows (the import before)."""
    ref = copy.deepcopy(model)
    for b in ref.blocks:
        lin = b.attn.qkv_proj
        if isinstance(lin, JoinedLinear):
            b.attn.qkv_proj = BlockLinear(torch.cat(lin.rows).clone(), lin.fmt, lin.bias)
        else:
            b.attn.qkv_proj = StackedLinear([BlockLinear(p.blocks.clone(), p.fmt, p.bias) for p in lin.parts])
    return ref


def logits(model, ids):
    """A prompt's logits, then three decode steps', through whichever route the model's choice takes."""
    with torch.inference_mode():
        state = model.new_state(1, ids.shape[1] + 4)
        out = [prefill(model, ids, state)]
        out += [decode_step(model, torch.tensor([[t]]), state) for t in (3, 5, 7)]
    return torch.cat([o.reshape(1, -1) for o in out])


def assert_joined_logits(model, monkeypatch) -> None:
    """``model``'s logits equal :func:`joined_copy`'s bit for bit, on the whole-layer call and on the module path."""
    ref = joined_copy(model)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(0))
    for fused in ("1", "0"):
        monkeypatch.setenv("TFORMER_FUSED_DECODE", fused)
        choose(model), choose(ref)
        assert torch.equal(logits(model, ids), logits(ref, ids))


@pytest.mark.parametrize("name", list(FILES))
def test_qkv_stay_file_views_and_the_logits_are_the_joined_matrix(files, name, monkeypatch):
    model = open_model(str(files[name]), threads=1).model
    q_, kv_, _ = FILES[name]
    for b in model.blocks:
        lin = b.attn.qkv_proj
        parts = lin.rows if isinstance(lin, JoinedLinear) else [p.blocks for p in lin.parts]
        assert isinstance(lin, JoinedLinear if q_ == kv_ else StackedLinear)
        assert [p.shape[0] for p in parts] == [256, 128, 128]
        assert all(pages.mapped(p) for p in parts)                  # the file's pages, not a copy
    assert_joined_logits(model, monkeypatch)
    tiles = qgemv.path() in qgemv.TILE_ROWS and qgemv.load() is not None
    for b in model.blocks:
        lin = b.attn.qkv_proj
        if isinstance(lin, JoinedLinear) and lin.tiled and tiles:
            assert lin._joined is None                              # read as tiles only: no joined copy held
        elif isinstance(lin, JoinedLinear):
            joined = lin.file_layout()
            assert lin._joined is joined and lin.file_layout() is joined   # made once
            assert torch.equal(joined, torch.cat([r.clone() for r in lin.rows]))


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="/proc/self/pagemap is Linux's")
def test_llama_q_and_k_are_copies_whose_file_pages_go_back(llama_file, monkeypatch):
    from tformer.interop.gguf_reader import GGUFFile
    model = open_model(str(llama_file), threads=1).model
    f = GGUFFile(llama_file)
    for i, b in enumerate(model.blocks):
        lin = b.attn.qkv_proj
        assert isinstance(lin, JoinedLinear)
        q, k, v = lin.rows
        assert not pages.mapped(q) and not pages.mapped(k) and pages.mapped(v)
        base = v.data_ptr() - f.tensors[f"blk.{i}.attn_v.weight"].offset       # the model's mapping of the file
        for p in "qk":
            t = f.tensors[f"blk.{i}.attn_{p}.weight"]
            assert t.nbytes >= 4 * 4096 and present_pages(base + t.offset, t.nbytes) == 0   # its pages went back
    assert_joined_logits(model, monkeypatch)
