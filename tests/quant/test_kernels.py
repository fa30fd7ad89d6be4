"""Decode kernels: tformer's GEMV (both SIMD paths, AVX-512 and AVX2, the AVX2 one forced on an
AVX-512 machine) and torch's int4 kernel against float64 references, the
measured-once kernel choice and its cache, and the fallback to torch when the extension is missing.

Tolerances: the GEMV accumulates float32 products (the weights are widened exactly), so against a
float64 reference its error is at most ~K·2⁻²⁴·Σ|W_k x_k| from the sums (1e-5 · Σ|W x| is asked, far
above that bound for K ≤ 3072 and far below any rounding of the output) plus half an ulp of the
output dtype: 2⁻⁸ relative for bfloat16, 2⁻¹¹ for float16, 2⁻²⁴ for float32.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from tformer.quant import gemv, kernels, qgemv
from tformer.quant.quantize import (DecodeLinear, decode_layer, Int4Linear, Int8Linear, quantize_weight, quantize_weight_int4,
                                        set_precision)

pytestmark = pytest.mark.usefixtures("one_thread")
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}   # machine epsilon


def ext():
    op = gemv.load()
    if op is None:
        pytest.skip(f"tformer's GEMV extension is {gemv.STATUS.get('state')}")
    return op


@pytest.fixture(params=["avx2", "avx512"])
def simd(request, monkeypatch):
    """Each SIMD path of the GEMV, forced (skipped where this CPU does not run it)."""
    ext()
    monkeypatch.setenv(gemv.FORCED, request.param)
    if gemv.path() != request.param:
        pytest.skip(f"this CPU does not run the {request.param} path")
    return request.param


def assert_gemv_close(y, ref, w, x, scales=None):
    mag = (w.double().abs() @ x.double().abs()) * (scales.double().abs() if scales is not None else 1)   # (N,) Σ|W x|
    bound = 1e-5 * mag + ULP[y.dtype] / 2 * ref.abs() + 1e-30
    assert bool(((y.double() - ref).abs() <= bound).all()), float(((y.double() - ref).abs() / bound).max())


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("n, k", [(37, 768), (4, 3072), (9, 40), (1, 7)])   # tails in N (not /4) and K (not /16)
def test_ext_gemv_matches_float64_reference(wdtype, n, k, simd):
    op = ext()
    assert op.keywords["path"] == gemv.PATHS.index(simd)
    g = torch.Generator().manual_seed(n * k)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8) if wdtype == torch.int8 \
        else torch.randn(n, k, generator=g).to(wdtype)
    xdtype = torch.float32 if wdtype == torch.float32 else torch.bfloat16
    x = torch.randn(k, generator=g).to(xdtype)
    scales = torch.rand(n, generator=g) / 50 if wdtype == torch.int8 else None
    bias = torch.randn(n, generator=g)
    y = op(w, x, scales, bias)
    assert y.dtype == xdtype and y.shape == (n,)
    assert_gemv_close(y, gemv.reference(w, x, scales, bias), w, x, scales)


def test_ext_gemv_refuses_bad_input():
    op = ext()
    with pytest.raises(RuntimeError, match="x must be"):
        op(torch.randn(4, 8), torch.randn(9), None, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(torch.randn(8, 4).t(), torch.randn(8), None, None)


@pytest.mark.parametrize("kernel", ["linear", "mv", "mm_t", "ext"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3])
def test_every_decode_kernel_equals_float64_linear(kernel, dtype, rows):
    if kernel == "ext":
        ext()
    torch.manual_seed(0)
    lin = nn.Linear(96, 72).to(dtype)
    x = torch.randn(rows, 96).to(dtype)
    layer = DecodeLinear(lin, kernel=kernel)
    assert layer.kernel == kernel
    ref = x.double() @ lin.weight.double().T + lin.bias.double()
    out = layer(x)
    assert out.dtype == dtype
    # torch's own bf16/fp16 kernels may round partial sums to the dtype: allow 4 ulps of Σ|W x| there
    slack = (x.double().abs() @ lin.weight.double().abs().T) * ULP[dtype] * 4
    assert bool(((out.double() - ref).abs() <= slack + 1e-6).all())


def test_int8_ext_equals_int8pack_and_the_dequantised_reference(monkeypatch):
    ext()
    torch.manual_seed(0)
    lin = nn.Linear(64, 80)
    monkeypatch.setenv(kernels.FORCED, "ext")
    fast = Int8Linear(lin)
    monkeypatch.setenv(kernels.FORCED, "int8pack")
    torch_kernel = Int8Linear(lin)
    assert (fast.kernel, torch_kernel.kernel) == ("ext", "int8pack")
    x = torch.randn(1, 64).bfloat16()
    q, _ = quantize_weight(lin.weight)
    ref = gemv.reference(q, x[0], fast.scales.float(), lin.bias.detach())
    assert_gemv_close(fast(x)[0], ref, q, x[0], fast.scales.float())
    assert (fast(x).float() - torch_kernel(x).float()).abs().max() <= 2 * ULP[torch.bfloat16] * ref.abs().max()


def test_int4_quantisation_bound_and_kernel_against_dequantised_reference():
    torch.manual_seed(0)
    lin = nn.Linear(128, 40)                                   # 40 rows: padded to 48 for the kernel
    q, sz = quantize_weight_int4(lin.weight, 32)
    s, z = sz.double()[..., 0].T, sz.double()[..., 1].T        # (Np, G)
    deq = ((q.double().view(48, 4, 32) - 8) * s[..., None] + z[..., None]).view(48, 128)[:40]
    # rounding to the 16 levels: half a step, plus the bf16 rounding of s and z (scaled by |q - 8| <= 8)
    step = s[:40].repeat_interleave(32, dim=1)
    err = (deq - lin.weight.double()).abs()
    assert bool((err <= step / 2 + 2**-8 * (8 * step + z[:40].abs().repeat_interleave(32, dim=1)) + 1e-7).all())
    layer = Int4Linear(lin)
    x = torch.randn(3, 128).bfloat16()
    out = layer(x)
    assert out.shape == (3, 40) and out.dtype == torch.bfloat16
    ref = x.double() @ deq.T + lin.bias.double()
    # torch's kernel takes bf16 activations and returns bf16: a few bf16 ulps of Σ|W x| (measured < 1 ulp)
    mag = x.double().abs() @ deq.abs().T
    assert bool(((out.double() - ref).abs() <= 4 * ULP[torch.bfloat16] * mag).all())


def test_int4_model_generates_close_to_fp32():
    from test_quantize import tiny
    from tformer.generation.generate import generate

    ref, model = tiny(), set_precision(tiny(), "int4")
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 2 * 5 + 1
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        l_ref, l_q = ref(ids)[0], model(ids)[0].float()
    assert (l_ref - l_q).abs().max() < 0.1 * l_ref.abs().max()       # 16 levels: measured 2.6% of max |logit|
    assert generate(model, ids, 6, temperature=0).shape == (1, 10)


def test_choice_is_measured_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path))
    monkeypatch.delenv(kernels.FORCED, raising=False)
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    calls = []

    def fake_measure(kind, make):
        calls.append(kind)
        return {"linear": 2.0, "mv": 1.0}
    monkeypatch.setattr(kernels, "measure", fake_measure)
    monkeypatch.setattr(kernels, "available", lambda kind: ("linear", "mv"))
    assert kernels.choose("bf16", decode_layer) == "mv" and kernels.choose("bf16", decode_layer) == "mv"
    assert calls == ["bf16"]
    stored = json.loads((tmp_path / "kernels.json").read_text())
    assert stored[kernels.machine_key()]["bf16"]["kernel"] == "mv"
    monkeypatch.setattr(kernels, "_CHOSEN", {})                      # a new process reads the file
    assert kernels.choose("bf16", decode_layer) == "mv" and calls == ["bf16"]


def test_measure_times_every_available_candidate():
    times = kernels.measure("bf16", decode_layer, copies=1, rounds=1, d=64)
    assert set(times) == set(kernels.available("bf16")) and all(t > 0 for t in times.values())


def test_without_the_extension_torch_kernels_run_and_agree(tmp_path):
    """A machine where the extension cannot be built (forced here) falls back to torch's kernels."""
    code = ("import torch, torch.nn as nn\n"
            "from tformer.quant import gemv, kernels\n"
            "from tformer.quant.quantize import DecodeLinear, Int8Linear\n"
            "torch.manual_seed(0); lin = nn.Linear(64, 32).bfloat16(); x = torch.randn(1, 64).bfloat16()\n"
            "d, q = DecodeLinear(lin), Int8Linear(lin)\n"
            "assert gemv.load() is None and gemv.STATUS['state'].startswith('unavailable'), gemv.STATUS\n"
            "assert d.kernel != 'ext' and q.kernel == 'int8pack', (d.kernel, q.kernel)\n"
            "ref = x.double() @ lin.weight.double().T + lin.bias.double()\n"
            "assert (d(x).double() - ref).abs().max() < 0.02 * ref.abs().max()\n"
            "print('fallback', d.kernel, q.kernel)\n")
    env = dict(os.environ, TFORMER_NO_EXTENSION="1", TFORMER_CACHE=str(tmp_path))
    env.pop(kernels.FORCED, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "fallback" in out.stdout


def test_forget_drops_only_this_machines_choices(monkeypatch, tmp_path):
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path))
    (tmp_path / "kernels.json").write_text(json.dumps({kernels.machine_key(): {"bf16": {"kernel": "mv"}},
                                                       "other cpu": {"bf16": {"kernel": "linear"}}}))
    assert kernels.chosen() == {"bf16": {"kernel": "mv"}}
    kernels.forget()
    assert kernels.chosen() == {} and "other cpu" in json.loads((tmp_path / "kernels.json").read_text())


@pytest.mark.parametrize("n, k", [(37, 768), (5, 64), (1, 32)])
def test_ext_int4_gemv_matches_float64_reference(n, k, simd):
    ext()
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(0, 16, (n, k), generator=g)
    s, c = torch.rand(n, k // 32, generator=g) / 10, torch.randn(n, k // 32, generator=g) / 10
    x, b = torch.randn(k, generator=g).bfloat16(), torch.randn(n, generator=g)
    y = gemv.load_q4()(gemv.pack_int4(q), x, s, c, b)
    w = q.double() * s.double().repeat_interleave(32, 1) + c.double().repeat_interleave(32, 1)
    assert y.dtype == torch.bfloat16
    assert_gemv_close(y, gemv.reference_q4(q, s, c, x, b), w, x)


@pytest.mark.parametrize("kernel", ["ext", "int4pack"])
def test_int4_linear_one_row_equals_the_dequantised_reference_with_either_kernel(kernel, monkeypatch):
    if kernel == "ext":
        ext()
    monkeypatch.setenv(kernels.FORCED, kernel)
    torch.manual_seed(0)
    lin = nn.Linear(96, 40)
    layer = Int4Linear(lin)
    assert layer.kernel == kernel
    q, sz = quantize_weight_int4(lin.weight, 32)
    s, z = sz.double()[..., 0].T[:40], sz.double()[..., 1].T[:40]
    deq = (q[:40].double().view(40, 3, 32) - 8) * s[..., None] + z[..., None]
    x = torch.randn(1, 96).bfloat16()
    ref = x.double() @ deq.view(40, 96).T + lin.bias.double()
    mag = x.double().abs() @ deq.view(40, 96).abs().T
    assert bool(((layer(x).double() - ref).abs() <= 4 * ULP[torch.bfloat16] * mag).all())


# ------------------------------------------------------------------ several rows (prefill)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", ["native", "fp32", "tiles"])
def test_prefill_products_match_float64_reference(dtype, kernel):
    """Every several-row product is the float64 product up to float32-class sums (accumulated in
    float32 by all: oneDNN's bf16 GEMM accumulates in float32 too) and one rounding to the dtype.
    K = 200 leaves a tail after the 8-lane steps and M = 9, N = 96 leave partial register tiles."""
    if kernel == "tiles" and gemv.load_gemm() is None:
        pytest.skip(f"the extension is unavailable: {gemv.STATUS.get('state')}")
    g = torch.Generator().manual_seed(7)
    w, x, b = (torch.randn(96, 200, generator=g).to(dtype), torch.randn(9, 200, generator=g).to(dtype),
               torch.randn(96, generator=g).to(dtype))
    y = kernels.prefill_product(kernel, x, w, b)
    ref = x.double() @ w.double().T + b.double()
    mag = x.double().abs() @ w.double().abs().T + b.double().abs()
    assert y.dtype == dtype and y.shape == (9, 96)
    assert bool(((y.double() - ref).abs() <= 1e-5 * mag + ULP[dtype] * ref.abs() + 1e-30).all())


def test_prefill_choice_is_measured_once_stored_and_forced(monkeypatch, tmp_path):
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path))
    monkeypatch.delenv(kernels.PREFILL_FORCED, raising=False)
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    calls = []
    real = kernels.measure_prefill
    monkeypatch.setattr(kernels, "measure_prefill", lambda kind: calls.append(kind) or real(kind, rows=4, copies=1,
                                                                                            rounds=1, d=64))
    first = kernels.choose_prefill("bf16")
    have = set(kernels.prefill_available("bf16"))
    assert first in have and calls == ["bf16"] and {"native", "fp32"} <= have
    stored = kernels.chosen()["bf16-prefill"]
    assert stored["kernel"] == first and set(stored["seconds"]) == have
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    assert kernels.choose_prefill("bf16") == first and calls == ["bf16"]          # read back, not measured again
    assert kernels.choose_prefill("int8") == "native"                             # nothing to choose
    monkeypatch.setenv(kernels.PREFILL_FORCED, "fp32")
    assert kernels.choose_prefill("bf16") == "fp32"


def test_a_stored_prefill_choice_is_measured_again_when_the_candidates_change(monkeypatch, tmp_path):
    """A choice stored before a candidate existed (``tiles``) is not kept: the new set is measured."""
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path))
    monkeypatch.delenv(kernels.PREFILL_FORCED, raising=False)
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    monkeypatch.setattr(kernels, "prefill_available", lambda kind: ("native", "fp32", "tiles"))
    (tmp_path / "kernels.json").write_text(json.dumps(
        {kernels.machine_key(): {"fp16-prefill": {"kernel": "fp32", "seconds": {"native": 2.0, "fp32": 1.0}}}}))
    monkeypatch.setattr(kernels, "measure_prefill", lambda kind: {"native": 3.0, "fp32": 2.0, "tiles": 1.0})
    assert kernels.choose_prefill("fp16") == "tiles"
    assert kernels.chosen()["fp16-prefill"]["kernel"] == "tiles"


def test_decode_linear_runs_several_rows_through_the_chosen_prefill_product(monkeypatch):
    monkeypatch.setenv(kernels.PREFILL_FORCED, "fp32")
    torch.manual_seed(3)
    lin = nn.Linear(64, 48).bfloat16()
    layer = DecodeLinear(lin)
    assert layer.prefill == "fp32"
    x = torch.randn(2, 5, 64).bfloat16()
    with torch.inference_mode():
        y = layer(x)
    want = kernels.prefill_product("fp32", x.reshape(10, 64), lin.weight, lin.bias).view(2, 5, 48)
    assert torch.equal(y, want)


def test_a_choice_under_an_isa_limit_is_stored_apart(monkeypatch):
    """A choice measured with torch held to AVX2 (ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY) is not the
    full machine's: the stored key names the limit."""
    for k in kernels.ISA_LIMITS:
        monkeypatch.delenv(k, raising=False)
    plain = kernels.machine_key()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    held = kernels.machine_key()
    assert held != plain and held.startswith(plain) and "ONEDNN_MAX_CPU_ISA=AVX2" in held


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mkn", [(1, 8, 3), (7, 13, 5), (4, 1030, 9), (130, 520, 7)])
def test_several_row_gemm_matches_float64_and_leaves_its_bias_alone(dtype, mkn):
    """gemv.cpp's ``gemm`` (the 4 × 3 register tiles): every tile shape at the edges (M % 4, N % 3),
    a K tail after the 8-lane steps, a long K (1030: each tile runs the whole of K); float32 sums of at most K
    terms, so within 1e-5 of Σ|x w| against float64. One row with a bias once handed the bias back as
    its output and added into it: the bias must come out untouched."""
    op = gemv.load_gemm()
    if op is None:
        pytest.skip(f"the extension is unavailable: {gemv.STATUS.get('state')}")
    M, K, N = mkn
    g = torch.Generator().manual_seed(M * 1000 + K)
    w, x, b = torch.randn(N, K, generator=g).to(dtype), torch.randn(M, K, generator=g), torch.randn(N, generator=g)
    kept = b.clone()
    y = op(w, x, b)
    ref = x.double() @ w.double().T + b.double()
    mag = x.double().abs() @ w.double().abs().T + b.double().abs()
    assert y.shape == (M, N) and y.dtype == torch.float32 and torch.equal(b, kept)
    assert bool(((y.double() - ref).abs() <= 1e-5 * mag).all())
    assert bool(((op(w, x).double() - (ref - b.double())).abs() <= 1e-5 * mag).all())
    y16 = op(w, x.to(torch.bfloat16))                                  # x in another dtype: the result in it
    assert y16.dtype == torch.bfloat16


def test_a_choice_stored_while_another_is_measured_is_kept(monkeypatch, tmp_path):
    """Timing the one-row kernels builds DecodeLinears, which choose (and store) their prefill product
    meanwhile; storing the one-row choice must not write back the file as it was before and drop that."""
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path))
    monkeypatch.delenv(kernels.FORCED, raising=False)
    monkeypatch.delenv(kernels.PREFILL_FORCED, raising=False)
    monkeypatch.setattr(kernels, "_CHOSEN", {})

    def timings():                     # the nested choice, made while the outer one is being measured
        kernels._chosen("fp16-prefill", ("native", "fp32"), lambda: {"native": 2.0, "fp32": 1.0})
        return {"linear": 1.0, "ext": 2.0}
    assert kernels._chosen("fp16", ("linear", "ext"), timings) == "linear"
    stored = kernels.chosen()
    assert stored["fp16"]["kernel"] == "linear" and stored["fp16-prefill"]["kernel"] == "fp32"


def test_decode_linear_with_the_tiles_prefill_agrees_and_falls_back_under_autograd(monkeypatch):
    """Several rows through ``tiles`` equal the float64 product within float32 sums; under autograd the
    layer takes F.linear (the op has no backward), so a gradient still reaches the input."""
    if gemv.load_gemm() is None:
        pytest.skip(f"the extension is unavailable: {gemv.STATUS.get('state')}")
    monkeypatch.setenv(kernels.PREFILL_FORCED, "tiles")
    torch.manual_seed(4)
    lin = nn.Linear(64, 48)
    layer = DecodeLinear(lin)
    assert layer.prefill == "tiles"
    x = torch.randn(2, 5, 64)
    with torch.inference_mode():
        y = layer(x)
    ref = x.double() @ lin.weight.double().T + lin.bias.double()
    assert (y.double() - ref).abs().max() < 1e-5 * (x.double().abs() @ lin.weight.double().abs().T).max()
    xg = x.clone().requires_grad_()
    layer(xg).sum().backward()
    assert xg.grad is not None and torch.allclose(xg.grad, lin.weight.detach().sum(0).expand(2, 5, 64), atol=1e-5)


def test_a_choice_measured_with_other_kernel_sources_is_not_reused(monkeypatch):
    """The stored key names a digest of gemv.cpp, qgemv.cpp and their headers: after an edit of a
    kernel (a new tile loop, say) the machine measures its choice again instead of keeping one made
    with the old code."""
    now = kernels.machine_key()
    files = [gemv.SOURCE, gemv.HEADER, qgemv.SOURCE, qgemv.TILES, qgemv.KQUANTS, qgemv.SOURCE.with_name("kprefill.h")]     # named here, not from the code under test
    assert f"kernels {kernels.source_digest(files)}" in now
    monkeypatch.setattr(kernels, "_sources", lambda: "000000000000")
    assert kernels.machine_key() != now
