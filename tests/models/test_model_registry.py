"""A new model family is one module plus one line in ``tformer.models.MODELS``: registered so, a
family defined here builds from its config and saves and loads through ``tformer.checkpoint``
with its constructor switch, which no generic module names.

Reference: the same model's logits before saving and after loading (bit-equal), and the switch
read back from the weights.
"""

import pytest
import torch
import torch.nn as nn

from tformer.checkpoint import load_model, save_model
from tformer.config import TransformerConfig
from tformer.models import MODELS, build_model
from tformer.models.decoder import DecoderLM


class ScaledHeadLM(DecoderLM):
    """A decoder whose optional ``temperature`` parameter divides its logits (the switch)."""

    def __init__(self, config: TransformerConfig, temperature: bool = False):
        super().__init__(config)
        self.temperature = nn.Parameter(torch.tensor(2.0)) if temperature else None

    @staticmethod
    def options_from_state(state: dict) -> dict:
        return {"temperature": "temperature" in state}

    def forward(self, ids, targets=None, **kw):
        logits, loss = super().forward(ids, targets, **kw)
        return (logits / self.temperature if self.temperature is not None else logits), loss


@pytest.fixture
def family(monkeypatch):
    monkeypatch.setitem(MODELS, "scaled-head", f"{__name__}:ScaledHeadLM")      # the one registration


@pytest.mark.parametrize("switch", [False, True])
def test_a_registered_family_builds_saves_and_loads(family, tmp_path, switch):
    torch.manual_seed(0)
    c = TransformerConfig(model="scaled-head", vocab_size=30, context_length=16, n_layers=1, d_model=16, n_heads=2)
    model = build_model(c, temperature=switch).eval()
    assert type(model) is ScaledHeadLM
    ids = torch.randint(0, 30, (2, 7))
    expected, _ = model(ids)
    save_model(tmp_path, model)
    loaded = load_model(tmp_path).eval()
    assert type(loaded) is ScaledHeadLM and (loaded.temperature is not None) == switch
    got, _ = loaded(ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
