"""Generation speed: tformer (KV cache, fp32/bf16/fp16/int8/int4, no cache) against llama.cpp
(f32/f16/bf16/q8_0/q4_0, through llama-cpp-python, on the GGUF tformer exports of the same weights)
and HF transformers (the same weights), on the GPT-2 124M shape (random weights), plus nanoGPT's two
CPU shapes, in one run; contenders alternate round by round.

Goals, stated before the runs (issue 17): each tformer precision decodes at least as fast as
llama.cpp's matching type (fp32-f32, bf16-bf16, fp16-f16, int8-q8_0, int4-q4_0), and bf16 and int8
decode read their weights at >= 70% of the measured read bandwidth. Before timing, llama.cpp's f32
logits on the exported file must equal tformer's within 1e-3 and its greedy tokens must match
(asserted; reported in the results).

    PYTHONPATH=$PWD/src python benchmarks/generation/generate.py --prepare          # export GGUFs (untimed)
    flock /tmp/tformer-bench.lock env PYTHONPATH=$PWD/src python benchmarks/generation/generate.py \
        --skip nanogpt latency accuracy --out benchmarks/results/generation/generate_llama_cpp.md

Prints one table (tokens/s, ratios, the share of read bandwidth: weight bytes x tokens/s over the
machine's measured read bandwidth), writes ``--out`` (default benchmarks/results/generation/generate.md)
and, beside it, ``<out stem>_latency.png``: per-token latency against context position with and
without the cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from tformer import DecoderLM, TransformerConfig
from tformer.fused.report import kernels_of
from tformer.generation.generate import generate
from tformer.quant.quantize import set_precision, weight_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, load_note, results_dir  # noqa: E402
from common.measure import read_bandwidth  # noqa: E402

RAN: dict[str, str] = {}    # contender -> the kernels its linear layers run (filled by gpt2_contenders)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


GGUF_DIR = Path("/tmp/tformer-gguf")     # exported files, reused between runs (same seed, same weights)
MATCH = {"fp32": "f32", "bf16": "bf16", "fp16": "f16", "int8": "q8_0", "int4": "q4_0", "q8_0": "q8_0", "q4_0": "q4_0"}
# block types: llama.cpp's default (its weights repacked for this CPU at load; decode's peer) and with
# the repacking off (the file's layout, as tformer reads it; its prompt can go in as one batch)
REPACK_OFF = " repack off"


def base_model(config: TransformerConfig) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(config).eval()


def one_by_one_of(row: dict) -> bool:
    """Whether a llama.cpp row's prompt went in one token at a time (its prefill is not comparable)."""
    return "one token at a time" in RAN.get(row["name"], "")


def gguf_files(base: DecoderLM, kinds: list[str]) -> dict[str, Path]:
    """The GGUF of ``base`` per type, exported once into GGUF_DIR (a stamp file names the weights' seed)."""
    from tformer.interop.llama_cpp import export

    stamp = GGUF_DIR / "weights-gpt2-124m-seed0"
    missing = [k for k in kinds if not (GGUF_DIR / f"model-{k}.gguf").exists()] if stamp.exists() else kinds
    if missing:
        print(f"exporting GGUF {missing} to {GGUF_DIR}", file=sys.stderr, flush=True)
        export(base, GGUF_DIR, missing, model_type="gpt2")
        stamp.touch()
    return {k: GGUF_DIR / f"model-{k}.gguf" for k in kinds}


def gguf_read_bytes(path: Path) -> int:
    """Bytes of the GGUF's tensors a decode step reads (all but the position table, of which it reads a row)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if t.name != "position_embd.weight")


@torch.inference_mode()
def llama_cpp_parity(base: DecoderLM, path: Path, prompt: torch.Tensor, new: int = 16) -> dict:
    """llama.cpp's logits on the f32 GGUF (float32 KV cache) against tformer fp32's, and greedy tokens.

    ggml computes GELU through a float16 table; over GPT-2 124M's 12 layers that alone moves logits by
    ~1e-3. So the same comparison is also made against tformer with that rounding emulated
    (``with_ggml_gelu``): that one is asserted (<= 1e-3, greedy tokens equal); both are reported."""
    from tformer.interop.llama_cpp import LlamaCpp, with_ggml_gelu

    cpp = LlamaCpp(path, n_ctx=prompt.shape[1] + new, threads=torch.get_num_threads(), logits_all=True,
                   f32_cache=True)
    theirs = cpp.logits(prompt[0].tolist())
    got = cpp.generate(prompt[0].tolist(), new)
    del cpp
    row = dict(tokens=new)
    for label, model in (("plain", base), ("ggml_gelu", with_ggml_gelu(base))):
        ours = model(prompt)[0][0].numpy()
        ref = generate(model, prompt, new, temperature=0)[0, prompt.shape[1]:].tolist()
        row[label] = dict(max_err=float(abs(theirs - ours).max()), scale=float(abs(ours).max()),
                          agree=sum(a == b for a, b in zip(ref, got)))
    e = row["ggml_gelu"]
    assert e["max_err"] <= 1e-3, f"llama.cpp's f32 logits differ from tformer's by {e['max_err']:.2e} (> 1e-3)"
    assert e["agree"] == new, f"llama.cpp's greedy tokens agree with tformer's on {e['agree']}/{new} only"
    return row


def gpt2_contenders(args, parity_rows: list) -> dict:
    """name -> (run(), new tokens, weight bytes, prefill-only run or None); the same weights for all."""
    import copy

    config = TransformerConfig.from_name("gpt2-124m")
    base = base_model(config)
    ids = torch.randint(0, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    n = args.new_tokens
    out = {}
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        from tformer.interop.hf import family

        hf = GPT2LMHeadModel(GPT2Config()).eval()
        sd = {k: v.float() for k, v in base.state_dict().items()}
        missing, unexpected = hf.load_state_dict(family("gpt2").state_to_hf(sd, config), strict=False)
        assert not unexpected and all("attn.bias" in k or "masked_bias" in k or k == "lm_head.weight"
                                      for k in missing), (missing, unexpected)
        hf.tie_weights()
        mask = torch.ones_like(ids)

        def hf_run(k=n):
            with torch.no_grad():
                hf.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                            pad_token_id=0)
        out["HF transformers fp32"] = (hf_run, n, weight_bytes(base), lambda: hf_run(1))
        RAN["HF transformers fp32"] = kernels_of(hf)
    except ImportError:
        print("transformers is not installed: no HF row", file=sys.stderr)
    for precision in args.precisions:
        plain = precision.endswith("-linear")      # the default F.linear kernels, for comparison
        model = set_precision(copy.deepcopy(base), precision.removesuffix("-linear"), decode_kernels=not plain)
        out[f"tformer {precision}"] = (
            lambda m=model: generate(m, ids, n, temperature=0), n, weight_bytes(model),
            lambda m=model: generate(m, ids, 1, temperature=0))
        RAN[f"tformer {precision}"] = kernels_of(model)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed (pip install '.[bench]'): no llama.cpp rows", file=sys.stderr)
    else:
        from tformer.interop.llama_cpp import LlamaCpp, build_info

        built = build_info()
        files = gguf_files(base, args.llama_types)
        parity_rows.append(llama_cpp_parity(base, files["f32"], ids[:, :32]) if "f32" in files else {})
        for kind, path in files.items():
            # With q8_0 / q4_0 weights repacked (llama.cpp's default), a batch of more than one token stops
            # this llama.cpp build (0.3.36, built from PyPI here for the native CPU) with a general
            # protection fault in libggml-cpu's AMX-INT8 path: that prompt goes in one token at a time (its
            # prefill is not comparable); the same file with the repacking off takes the prompt as one
            # batch. A build without AMX (e.g. for AVX2 only) takes the repacked prompt as one batch.
            blocks = kind in ("q8_0", "q4_0")
            for repack in ((True, False) if blocks else (True,)):
                one_by_one = blocks and repack and "AMX" in built
                cpp = LlamaCpp(path, n_ctx=args.prompt + n, threads=args.threads, n_batch=1 if one_by_one else None,
                               repack=repack)
                prompt = ids[0].tolist()
                name = f"llama.cpp {kind}" + ("" if repack else REPACK_OFF)
                out[name] = (lambda c=cpp: c.generate(prompt, n), n, gguf_read_bytes(path), lambda c=cpp: c.generate(prompt, 1))
                RAN[name] = (f"ggml ({llama_cpp.__version__}), {kind} GGUF exported by tformer"
                             + (", prompt fed one token at a time (batched: crash)" if one_by_one else "")
                             + (", weights as the file stores them (use_extra_bufts off)" if not repack else ""))
    out["tformer no cache"] = (lambda: generate(base, ids, args.nocache_tokens, temperature=0, use_cache=False),
                               args.nocache_tokens, weight_bytes(base), None)
    RAN["tformer no cache"] = kernels_of(base) + ", full recomputation of the window every token"
    return out


def paired(row: dict, peer: dict, key: str) -> float:
    """The median over rounds of ``row``'s rate over ``peer``'s in the same round (``key``: the per-round
    rates); on a guest whose speed drifts between minutes it varies less than the ratio of the medians."""
    return statistics.median(a / b for a, b in zip(row[key], peer[key]))


def run_contenders(contenders: dict, repeats: int, bandwidth: float, prompt: int) -> list[dict]:
    """Alternate the contenders ``repeats`` times (one whole generation each, then its prefill alone);
    per round, decode tok/s = (n - 1) / (whole - prefill); medians and the range over rounds."""
    for name, (run, *_rest) in tqdm(contenders.items(), desc="warm-up", file=sys.stderr):
        if name != "tformer no cache":                 # first-call allocations, lazy init, kernel choice
            run()
    times = {name: [] for name in contenders}
    prefill = {name: [] for name in contenders}
    for r in tqdm(range(repeats), desc="rounds", file=sys.stderr):
        for name, (run, _n, _b, run_prefill) in contenders.items():
            if name == "tformer no cache" and r > 0:
                continue
            times[name].append(timed(run))
            if run_prefill is not None:
                prefill[name].append(timed(run_prefill))
            print(f"  repeat {r}: {name}: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
    rows = []
    for name, (_run, n, nbytes, _p) in contenders.items():
        total = statistics.median(times[name])
        row = dict(name=name, e2e=n / total, bytes=nbytes)
        if prefill[name]:
            dec = [(n - 1) / max(t - p, 1e-9) for t, p in zip(times[name], prefill[name])]
            row.update(decode=statistics.median(dec), decode_range=(min(dec), max(dec)), decode_rounds=dec,
                       prefill=prompt / statistics.median(prefill[name]),
                       prefill_rounds=[prompt / p for p in prefill[name]])
            row["roofline"] = nbytes * row["decode"] / (bandwidth * 1e9)
        else:
            row["roofline"] = nbytes * row["e2e"] / (bandwidth * 1e9)
        rows.append(row)
    return rows


def nanogpt_shapes(args) -> list[dict]:
    """tformer on nanoGPT's two CPU shapes, 500 tokens from a one-token prompt."""
    shapes = {
        "shakespeare_char (6L, 6H, d384, ctx 256)": TransformerConfig.from_name("shakespeare-char"),
        "CPU tiny (4L, 4H, d128, ctx 64)": TransformerConfig.from_name("tiny", vocab_size=65),
    }
    rows = []
    for label, config in shapes.items():
        torch.manual_seed(0)
        model = DecoderLM(config).eval()
        ids = torch.zeros(1, 1, dtype=torch.long)
        modes = {"cache, overflow=shift": dict(overflow="shift"),
                 "cache, overflow=window (nanoGPT's crop)": dict(overflow="window"),
                 "no cache (nanoGPT's algorithm)": dict(use_cache=False)}
        for mode, kw in modes.items():
            generate(model, ids, 20, temperature=0, **kw)
            ts = [timed(lambda: generate(model, ids, args.nanogpt_tokens, temperature=0, **kw))
                  for _ in range(args.nanogpt_repeats)]
            rows.append(dict(shape=label, mode=mode, tps=args.nanogpt_tokens / statistics.median(ts)))
            print(f"  {label} {mode}: {rows[-1]['tps']:.0f} tokens/s", file=sys.stderr, flush=True)
    return rows


@torch.inference_mode()
def latency_curve(positions: list[int], reps: int = 3) -> dict:
    """Seconds for one new token at each context position, with the cache and without (fp32)."""
    torch.manual_seed(0)
    config = TransformerConfig.from_name("gpt2-124m")
    model = set_precision(DecoderLM(config).eval(), "fp32")
    ids = torch.randint(0, config.vocab_size, (1, max(positions) + 1))
    cached, uncached = [], []
    model(ids[:, :8], last_only=True)                                   # warm-up
    for p in positions:
        # without a cache, the token at position p - 1 costs a forward pass over all p tokens
        uncached.append(statistics.median(timed(lambda: model(ids[:, :p], last_only=True)) for _ in range(reps)))
        # with the cache, it costs one token's forward over p cached keys: time tokens p-reps .. p-1
        state = model.new_state(1, p)
        model(ids[:, :p - reps], state=state, last_only=True)
        cached.append(statistics.median(
            timed(lambda t=t: model(ids[:, t:t + 1], state=state, last_only=True)) for t in range(p - reps, p)))
        print(f"  position {p}: cached {cached[-1] * 1e3:.1f} ms, uncached {uncached[-1] * 1e3:.1f} ms",
              file=sys.stderr, flush=True)
    return dict(positions=positions, cached=cached, uncached=uncached)


@torch.inference_mode()
def accuracy(precisions: list[str], n_prompts: int = 8, prompt_len: int = 32, new: int = 32) -> list[dict]:
    """Max |logit - fp32 logit| over a fixed prompt set, and greedy-token agreement with fp32."""
    config = TransformerConfig.from_name("gpt2-124m")
    torch.manual_seed(0)
    ref = DecoderLM(config).eval()
    state = ref.state_dict()
    prompts = torch.randint(0, config.vocab_size, (n_prompts, prompt_len), generator=torch.Generator().manual_seed(1))
    ref_logits = ref(prompts)[0]
    ref_tokens = generate(ref, prompts, new, temperature=0)[:, prompt_len:]
    rows = []
    for precision in precisions:
        if precision == "fp32" or precision.endswith("-linear"):
            continue
        model = DecoderLM(config).eval()
        model.load_state_dict(state)
        set_precision(model, precision)
        logits = model(prompts)[0].float()
        tokens = generate(model, prompts, new, temperature=0)[:, prompt_len:]
        rows.append(dict(precision=precision, max_err=(logits - ref_logits).abs().max().item(),
                         logit_scale=ref_logits.abs().max().item(),
                         first=(tokens[:, 0] == ref_tokens[:, 0]).float().mean().item(),
                         all=(tokens == ref_tokens).float().mean().item()))
    return rows


def plot(curve: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(curve["positions"], [t * 1e3 for t in curve["uncached"]], "o-", label="no cache (recompute)")
    ax.plot(curve["positions"], [t * 1e3 for t in curve["cached"]], "o-", label="KV cache")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context position (tokens)")
    ax.set_ylabel("latency of one new token (ms)")
    ax.set_title("GPT-2 124M fp32, 2 threads: per-token latency")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--nocache-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "fp16", "int8", "int4"])
    p.add_argument("--llama-types", nargs="*", default=["f32", "f16", "bf16", "q8_0", "q4_0"])
    p.add_argument("--prepare", action="store_true", help="only export the GGUF files (untimed), then exit")
    p.add_argument("--nanogpt-tokens", type=int, default=500)
    p.add_argument("--nanogpt-repeats", type=int, default=3)
    p.add_argument("--positions", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    p.add_argument("--skip", nargs="*", default=[], choices=["gpt2", "nanogpt", "latency", "accuracy"])
    p.add_argument("--out", default=str(results_dir("generation") / "generate.md"))
    args = p.parse_args()
    OUT[0] = Path(args.out)
    torch.set_num_threads(args.threads)
    if args.prepare:
        gguf_files(base_model(TransformerConfig.from_name("gpt2-124m")), args.llama_types)
        return
    RUN[0] = Run()
    lines = ["# Generation benchmark\n"]
    print(load_note(RUN[0].busy_before), file=sys.stderr)
    bandwidth = read_bandwidth()
    lines.append(f"measured read bandwidth (x.sum() over 512 MB, best of 9): {bandwidth:.1f} GB/s\n")
    print(lines[-1], file=sys.stderr)
    try:
        from tformer.interop.llama_cpp import build_info
        lines.append(f"llama.cpp: {build_info()}\n")
    except ImportError:
        pass

    if "gpt2" not in args.skip:
        from tformer.quant import kernels
        kernels.forget()                             # choose the decode kernels now, on the quiet machine
        parity: list[dict] = []
        rows = run_contenders(gpt2_contenders(args, parity), args.repeats, bandwidth, args.prompt)
        by = {r["name"]: r for r in rows}
        hf = by.get("HF transformers fp32", {}).get("e2e")
        if parity and parity[0]:
            q, g = parity[0]["plain"], parity[0]["ggml_gelu"]
            lines.append(f"llama.cpp on the f32 GGUF exported by tformer (same weights, float32 KV cache, 32-token "
                         f"prompt): max |logit difference| from tformer fp32 {q['max_err']:.1e} (logits up to "
                         f"{q['scale']:.2f}), greedy tokens {q['agree']}/{parity[0]['tokens']} equal; with ggml's "
                         f"float16 GELU table emulated in tformer: {g['max_err']:.1e}, {g['agree']}/"
                         f"{parity[0]['tokens']} (asserted: <= 1e-3 and all equal).\n")
        lines += [f"## GPT-2 124M shape (random weights, the same in every contender), batch 1, prompt {args.prompt}, "
                  f"{args.new_tokens} new tokens, greedy; median of {args.repeats} alternated rounds "
                  f"(decode: range over rounds; no cache: {args.nocache_tokens} new tokens, 1 run)\n",
                  "Each ratio is the ratio of the medians, and in brackets the median of the per-round ratios (each "
                  "round runs every contender once, one after the other, so a round's pair shares the machine's state "
                  "of that minute).\n",
                  "| contender | MB read per token | prefill tok/s | decode tok/s (range) | decode share of read bw | "
                  "decode x llama.cpp same type (its default) | prefill x llama.cpp (its faster row with the "
                  "prompt batched) | end-to-end x HF | kernel |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            kind = r["name"].split()[-1]
            peer = by.get(f"llama.cpp {MATCH.get(kind, '-')}") if r["name"].startswith("tformer") else None
            # prefill's peer: the faster of llama.cpp's rows whose prompt went in as one batch (with AMX in
            # the build the repacked row is fed token by token and only the repack-off row counts)
            off = by.get(f"llama.cpp {MATCH.get(kind, '-')}{REPACK_OFF}") if peer else None
            fed = [c for c in (peer, off) if c and "prefill" in c and not one_by_one_of(c)]
            batched = max(fed, key=lambda c: c["prefill"]) if fed else None
            ratio_dec = (f"{r['decode'] / peer['decode']:.2f} ({paired(r, peer, 'decode_rounds'):.2f})"
                         if peer and "decode" in r else "-")
            ratio_pre = (f"{r['prefill'] / batched['prefill']:.2f} ({paired(r, batched, 'prefill_rounds'):.2f})"
                         if batched and "prefill" in r else "-")
            dec = f"{r['decode']:.1f} ({r['decode_range'][0]:.1f}-{r['decode_range'][1]:.1f})" if "decode" in r else "-"
            pre = f"{r['prefill']:.0f}" if "prefill" in r else "-"
            lines.append(f"| {r['name']} | {r['bytes'] / 1e6:.0f} | {pre} | {dec} | {r['roofline']:.0%} | {ratio_dec} | "
                         f"{ratio_pre} | {r['e2e'] / hf:.2f} | {RAN.get(r['name'], '-')} |" if hf else
                         f"| {r['name']} | {r['bytes'] / 1e6:.0f} | {pre} | {dec} | {r['roofline']:.0%} | {ratio_dec} | "
                         f"{ratio_pre} | - | {RAN.get(r['name'], '-')} |")
        chosen = kernels.chosen()

        def times(keys) -> str:
            return "; ".join(f"{k}: " + ", ".join(f"{c} {t * 1e3:.2f}" for c, t in chosen[k]["seconds"].items())
                             + f" (chose {chosen[k]['kernel']})" for k in keys)
        lines.append("Kernel choice measured at the start of this run (tformer.quant.kernels), one row, ms per pass "
                     "over 8 x (768x3072, 3072x768) weights: " + times(k for k in chosen if not k.endswith("-prefill"))
                     + f"; several rows (prefill), ms per pass of {kernels.PREFILL_ROWS} rows over 2 x (768x3072, "
                     "3072x768): " + times(k for k in chosen if k.endswith("-prefill")) + "\n")
        save(lines)
    if "nanogpt" not in args.skip:
        rows = nanogpt_shapes(args)
        lines += [f"## nanoGPT shapes, fp32, {args.nanogpt_tokens} tokens from a 1-token prompt, "
                  f"median of {args.nanogpt_repeats}\n",
                  "| shape | mode | tok/s |", "|---|---|---:|"]
        lines += [f"| {r['shape']} | {r['mode']} | {r['tps']:.0f} |" for r in rows]
        lines.append("")
        save(lines)
    if "accuracy" not in args.skip:
        rows = accuracy(args.precisions)
        lines += ["## Accuracy against fp32 (GPT-2 124M shape, random weights; 8 prompts x 32 tokens, 32 greedy tokens)\n",
                  "| precision | max abs logit error | max abs fp32 logit | first greedy token agrees | all 32 agree |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {r['precision']} | {r['max_err']:.4f} | {r['logit_scale']:.2f} | {r['first']:.0%} | {r['all']:.0%} |"
                  for r in rows]
        lines.append("")
        save(lines)
    if "latency" not in args.skip:
        curve = latency_curve(args.positions)
        png = OUT[0].with_name(f"{OUT[0].stem}_latency.png")
        plot(curve, png)
        lines += ["## Per-token latency against context position (GPT-2 124M fp32), ms\n",
                  "| position | " + " | ".join(map(str, curve["positions"])) + " |",
                  "|---|" + "---:|" * len(curve["positions"]),
                  "| KV cache | " + " | ".join(f"{t * 1e3:.1f}" for t in curve["cached"]) + " |",
                  "| no cache | " + " | ".join(f"{t * 1e3:.1f}" for t in curve["uncached"]) + " |",
                  "", f"![latency]({png.name})", ""]
    RUN[0].finish()
    print(save(lines))


OUT = [results_dir("generation") / "generate.md"]
RUN: list = [None]      # the Run made in main()


def save(lines: list[str]) -> str:
    """Write what is measured so far to ``--out`` with the run's record (a crash later keeps it)."""
    text = "\n".join(lines)
    RUN[0].write(OUT[0], text + "\n")
    return text


if __name__ == "__main__":
    main()
