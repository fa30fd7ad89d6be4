"""Preference losses (:mod:`tformer.training.dpo`) against TRL (test-only reference, ``trl`` 1.16):

* ``sigmoid`` (ε = 0), ``robust`` (rDPO, ε = 0.1) and ``ipo``: TRL's ``DPOTrainer._compute_loss`` itself,
  called on a bare batch (a stand-in ``self`` holding the settings it reads and a stand-in model returning
  the per-token log-probabilities ``log_probs`` TRL's fused head gives), with precomputed reference
  log-probabilities (``precompute_ref_log_probs``);
* ``sigmoid`` with ε > 0 (cDPO) and ``simpo``: TRL's ``CPOTrainer.cpo_loss`` (its ``logits`` is the chosen
  minus the rejected input, so given the log-ratios it is cDPO on Δ; given mean log-probabilities, SimPO).

Loss and the gradient with respect to the policy's per-token log-probabilities within 1e-5 (fp32).
:func:`sequence_logps` is checked against transformers' logits on a random Llama (1e-5)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from tformer.training.dpo import preference_loss, sequence_logps

trl = pytest.importorskip("trl")
TOL = 1e-5
B, T = 4, 12


def batch(seed=0):
    """Per-token policy log-probs (2B, T-1) on a completion mask (chosen rows first), reference sums (B,)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * B, T, dtype=torch.long)
    for r in range(2 * B):
        start = int(torch.randint(2, 5, (1,), generator=g))
        end = int(torch.randint(start + 2, T + 1, (1,), generator=g))
        mask[r, start:end] = 1
    token = (-torch.rand(2 * B, T - 1, generator=g) * 3).requires_grad_()
    ref = -torch.rand(2 * B, generator=g) * 3 * mask[:, 1:].sum(1)
    return mask, token, ref


def trl_dpo(kind, beta, eps, mask, token, ref):
    from trl import DPOTrainer
    shift = mask[:, 1:]
    out = SimpleNamespace(log_probs=token * shift, entropy=torch.zeros_like(token),
                          mean_logits=torch.zeros_like(token), is_top1=torch.zeros_like(token, dtype=torch.bool))
    acc = SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x, gather=lambda x: x)
    fake = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=acc, aux_loss_enabled=False,
                           precompute_ref_logps=True, ld_alpha=None, f_divergence_type="reverse_kl", loss_types=[kind],
                           loss_weights=[1.0], beta=beta, label_smoothing=eps, use_weighting=False,
                           _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
                           args=SimpleNamespace())
    inputs = {"input_ids": torch.zeros(2 * B, T, dtype=torch.long), "attention_mask": torch.ones(2 * B, T),
              "completion_mask": mask, "ref_chosen_logps": ref[:B], "ref_rejected_logps": ref[B:]}
    return DPOTrainer._compute_loss(fake, lambda **kw: out, inputs, return_outputs=False)


def ours(kind, beta, eps, mask, token, ref, gamma=0.0):
    seq = (token * mask[:, 1:]).sum(1)
    n = mask[:, 1:].sum(1)
    rc, rr = (ref[:B], ref[B:]) if ref is not None else (None, None)
    losses, _, _ = preference_loss(seq[:B], seq[B:], rc, rr, beta=beta, kind=kind, label_smoothing=eps,
                                   n_chosen=n[:B], n_rejected=n[B:], gamma=gamma)
    return losses.mean()


def loss_and_grad(fn, token):
    token.grad = None
    loss = fn()
    loss.backward()
    return float(loss.detach()), token.grad.clone()


@pytest.mark.parametrize("kind,beta,eps", [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.0), ("robust", 0.1, 0.1),
                                           ("ipo", 0.1, 0.0)])
def test_loss_and_gradients_equal_trl_dpo_trainer(kind, beta, eps):
    mask, token, ref = batch()
    want, g_want = loss_and_grad(lambda: trl_dpo(kind, beta, eps, mask, token, ref), token)
    got, g_got = loss_and_grad(lambda: ours(kind, beta, eps, mask, token, ref), token)
    assert got == pytest.approx(want, rel=TOL, abs=TOL)
    assert float(g_want.abs().max()) > 1e-3                        # a real gradient, not an empty one
    assert torch.allclose(g_got, g_want, rtol=TOL, atol=TOL)


def cpo(kind, beta, eps, gamma=0.0):
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    fake = SimpleNamespace(alpha=0.0, beta=beta, label_smoothing=eps, loss_type=kind, simpo_gamma=gamma,
                           accelerator=SimpleNamespace(device="cpu"))
    return lambda chosen, rejected: CPOTrainer.cpo_loss(fake, chosen, rejected)[0].mean()


def test_conservative_dpo_equals_trl_cpo_sigmoid_on_the_log_ratios():
    mask, token, ref = batch(1)
    beta, eps = 0.2, 0.15

    def theirs():
        seq = (token * mask[:, 1:]).sum(1)
        return cpo("sigmoid", beta, eps)(seq[:B] - ref[:B], seq[B:] - ref[B:])
    want, g_want = loss_and_grad(theirs, token)
    got, g_got = loss_and_grad(lambda: ours("sigmoid", beta, eps, mask, token, ref), token)
    assert got == pytest.approx(want, rel=TOL) and torch.allclose(g_got, g_want, rtol=TOL, atol=TOL)


def test_simpo_equals_trl_cpo_simpo():
    mask, token, ref = batch(2)
    beta, eps, gamma = 2.0, 0.1, 0.5

    def theirs():
        n = mask[:, 1:].sum(1)
        mean = (token * mask[:, 1:]).sum(1) / n                 # TRL's SimPO takes average log-probabilities
        return cpo("simpo", beta, eps, gamma)(mean[:B], mean[B:])
    want, g_want = loss_and_grad(theirs, token)
    got, g_got = loss_and_grad(lambda: ours("simpo", beta, eps, mask, token, None, gamma), token)
    assert got == pytest.approx(want, rel=TOL) and torch.allclose(g_got, g_want, rtol=TOL, atol=TOL)


def test_sequence_logps_equal_transformers_log_softmax(tmp_path):
    import transformers
    from finetune_fixtures import tiny_llama
    from tformer.interop.hf import load_hf
    folder = tiny_llama(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    model = load_hf(folder).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf.config.vocab_size, (3, 10), generator=g)
    targets = torch.full((3, 10), -100)
    targets[0, 4:9], targets[1, 2:9], targets[2, 7:8] = ids[0, 5:10], ids[1, 3:10], ids[2, 8:9]
    targets[1, 9] = 5
    with torch.no_grad():
        got, n = sequence_logps(model, ids, targets)
        lp = torch.log_softmax(hf(ids).logits.float(), -1)
    keep = targets != -100
    want = torch.stack([lp[b][keep[b]].gather(-1, targets[b][keep[b]][:, None]).sum() for b in range(3)])
    assert n.tolist() == [5, 8, 1]
    assert torch.allclose(got, want, rtol=TOL, atol=TOL)
