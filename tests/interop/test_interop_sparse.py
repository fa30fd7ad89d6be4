"""HF Longformer and BigBird (random weights from a config, nothing downloaded) into tformer's
encoder with the longformer / bigbird mixers, hidden states against transformers' to 1e-4 (fp32),
in the configuration where HF runs its sparse path: Longformer with a window shorter than the
sequence and a global token; BigBird in eval mode, ``block_sparse``, a sequence longer than
(5 + 2r)·b. Export is checked by loading tformer's folder back into transformers.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
transformers = pytest.importorskip("transformers", reason="the optional extra 'hf' (transformers) is not installed")

from tformer.interop.hf import save_hf  # noqa: E402
from tformer.interop.hf import load_hf

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-4
V = 60


def _randomize(model):
    """Weights ~ N(0, 0.3), norm gains ~ 1 + N(0, 0.2): sharp attention, so a wrong pattern shows."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if p.dim() == 1 and name.endswith("weight") else 0.3 * noise)
    return model.eval()


def _longformer():
    torch.manual_seed(0)
    cfg = transformers.LongformerConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=48, attention_window=[8, 4], max_position_embeddings=66,
                                        pad_token_id=1, type_vocab_size=1)
    return _randomize(transformers.LongformerModel(cfg))


def _bigbird():
    torch.manual_seed(0)
    cfg = transformers.BigBirdConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, attention_type="block_sparse", block_size=4,
                                     num_random_blocks=2, max_position_embeddings=64)
    return _randomize(transformers.BigBirdModel(cfg))


def test_longformer_hidden_states_equal_transformers(tmp_path):
    hf = _longformer()
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    assert ours.config.mixer == "longformer" and ours.config.mixer_options["longformer"]["window"] == [5, 3]
    ids = torch.randint(2, V, (2, 40))                                       # no pad id: HF positions count on
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 33:] = 0                                                         # right padding in row 1
    glob = torch.zeros(2, 40, dtype=torch.long)
    glob[:, 0] = 1
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, global_attention_mask=glob).last_hidden_state
        got = ours(ids, attention_mask=mask, global_attention_mask=glob)
    real = mask.bool()
    assert (got - want)[real].abs().max().item() < TOL


def test_longformer_global_attention_mask_per_input_and_hf_default(tmp_path):
    """Issue 29, 17(a): HF takes the global tokens per call (default none); so does the converted
    model: its default call equals HF's default call, and a different global mask in each row
    (row 0: tokens 0 and 17; row 1: token 5 only) equals HF's to 1e-4."""
    hf = _longformer()
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    ids = torch.randint(2, V, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 30:] = 0
    glob = torch.zeros(2, 40, dtype=torch.long)
    glob[0, [0, 17]] = 1
    glob[1, 5] = 1
    real = mask.bool()
    with torch.no_grad():
        default_hf = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        default_ours = ours(ids, attention_mask=mask)
        want = hf(input_ids=ids, attention_mask=mask, global_attention_mask=glob).last_hidden_state
        got = ours(ids, attention_mask=mask, global_attention_mask=glob)
    assert (default_ours - default_hf)[real].abs().max().item() < TOL
    assert (got - want)[real].abs().max().item() < TOL
    assert (want - default_hf)[real].abs().max().item() > 100 * TOL                 # the mask matters


def test_bigbird_hidden_states_equal_transformers_in_block_sparse_mode(tmp_path):
    hf = _bigbird()
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    assert ours.config.mixer == "bigbird"
    ids = torch.randint(1, V, (2, 48))                                       # 12 blocks > 5 + 2·2
    with torch.no_grad():
        want = hf(input_ids=ids).last_hidden_state
        got = ours(ids)
    assert ours.blocks[0].attn.last_path[0] == "block-sparse"
    assert (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("build", [_longformer, _bigbird])
def test_export_loads_back_into_transformers(tmp_path, build):
    hf = build()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    save_hf(ours, tmp_path / "out")
    again = type(hf).from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(2, V, (1, 48))
    kw = {"global_attention_mask": torch.nn.functional.one_hot(torch.tensor([0]), 48)} if build is _longformer else {}
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids, **kw).last_hidden_state, again(input_ids=ids, **kw).last_hidden_state)
