"""The training step's memory savers change no number: tformer's AdamW against ``torch.optim.AdamW`` (bit for
bit, without importing ``torch._dynamo``), and SwiGLU's recomputing gated product against autograd on the
plain expression (bit for bit, keeping one ``(..., d_ff)`` tensor less for the backward)."""

import subprocess
import sys

import torch
import torch.nn.functional as F

from tformer import DecoderLM, TransformerConfig
from tformer.nn.feed_forward import SwiGLU
from tformer.training.optim import make_optimizer, param_groups


def _model(seed=0):
    torch.manual_seed(seed)
    return DecoderLM(TransformerConfig(vocab_size=13, context_length=8, n_layers=1, d_model=16, n_heads=2,
                                       ffn="swiglu", norm="rmsnorm", positions="rope", bias=False))


def test_adamw_equals_torch_adamw_bit_for_bit():
    ours_model, ref_model = _model(), _model()
    ours = make_optimizer(ours_model, 1e-2, (0.9, 0.95), 0.1)
    ref = torch.optim.AdamW(param_groups(ref_model, 0.1), lr=1e-2, betas=(0.9, 0.95), fused=True)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        for opt, model in ((ours, ours_model), (ref, ref_model)):
            for group in opt.param_groups:
                group["lr"] = 1e-2 * (step + 1) / 4                    # the loop's schedule sets it per step
        grads = [torch.randn(p.shape, generator=g) for p in ref_model.parameters()]
        for model in (ours_model, ref_model):
            for p, grad in zip(model.parameters(), grads):
                p.grad = grad.clone()
        ours.step(), ref.step()
        ours.zero_grad(), ref.zero_grad()
    for a, b in zip(ours_model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b) and a.grad is None
    sa, sb = ours.state_dict(), ref.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k in sb["state"]:
        assert all(torch.equal(sa["state"][k][n], sb["state"][k][n]) for n in ("step", "exp_avg", "exp_avg_sq"))
    ref.load_state_dict(sa)                                            # a checkpoint moves between the two


def test_adamw_does_not_import_the_compiler():
    code = ("import sys, torch\n"
            "from tformer.training.optim import make_optimizer\n"
            "from tformer import DecoderLM, TransformerConfig\n"
            "m = DecoderLM(TransformerConfig(vocab_size=11, context_length=8, n_layers=1, d_model=16, n_heads=2))\n"
            "before = 'torch._dynamo' in sys.modules\n"
            "opt = make_optimizer(m, 1e-3, (0.9, 0.99), 0.1)\n"
            "m(torch.zeros(1, 4, dtype=torch.long))[0].sum().backward()\n"
            "opt.step(); opt.zero_grad()\n"
            "print(before, 'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def _saved_bytes(fn):
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def test_swiglu_recomputes_silu_with_the_same_gradients():
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=11, context_length=8, n_layers=1, d_model=16, n_heads=2, ffn="swiglu",
                               d_ff=48, bias=False)
    ffn = SwiGLU(config)
    x = torch.randn(3, 5, 16, requires_grad=True)
    w = torch.randn(3, 5, 16)

    def plain():                                     # autograd on the expression: keeps gate, up and silu(gate)
        return F.linear(F.silu(F.linear(x, ffn.gate.weight)) * F.linear(x, ffn.up.weight), ffn.down.weight)
    ref, ref_bytes = _saved_bytes(plain)
    grads_ref = torch.autograd.grad((ref * w).sum(), [x, *ffn.parameters()])
    out, out_bytes = _saved_bytes(lambda: ffn(x))
    grads = torch.autograd.grad((out * w).sum(), [x, *ffn.parameters()])
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref))
    assert ref_bytes - out_bytes == 3 * 5 * 48 * 4                    # silu(gate), (B, T, d_ff) float32, not kept
