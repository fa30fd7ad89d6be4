"""Generation speed: tformer (KV cache, fp32/bf16/fp16/int8, no cache) against HF transformers,
on the GPT-2 124M shape (random weights), plus nanoGPT's two CPU shapes, in one run.

Run it alone (other benchmarks take the same lock):

    flock /tmp/tformer-bench.lock env PYTHONPATH=$PWD/src python benchmarks/generate.py

Prints one table (tokens/s, the ratio to HF, the roofline fraction: weight bytes x tokens/s over
the machine's measured read bandwidth), writes benchmarks/results/generate.md and a PNG of
per-token latency against context position with and without the cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from machine import busy_cores, load_note  # benchmarks/machine.py
from tformer import DecoderLM, TransformerConfig
from tformer.inference.generate import generate
from tformer.inference.quantize import set_precision, weight_bytes

RESULTS = Path(__file__).parent / "results"
KERNELS = {
    "fp32-linear": "F.linear (nn.Linear as is)",
    "bf16-linear": "F.linear (nn.Linear as is)",
    "fp32": "torch.addmm(b, x, Wᵀ) with Wᵀ stored (K, N) (MKL sgemm)",
    "bf16": "torch.mv(W, x) (one row); F.linear for prefill",
    "fp16": "F.linear (torch.mv measured ~3x slower for fp16)",
    "int8": "aten._weight_int8pack_mm, bf16 activations, per-channel scales",
    "no cache": "fp32, full recomputation of the window every token",
}


def read_bandwidth(mb: int = 512, reps: int = 9) -> float:
    """GB/s of ``x.sum()`` over ``mb`` MB of float32: the rate a decode step can read weights.

    The best of ``reps`` runs: other processes on the machine only ever lower it, and a roofline
    fraction must not be computed against a depressed ceiling."""
    x = torch.randn(mb * 2**20 // 4)
    x.sum()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.nbytes / min(times) / 1e9


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def gpt2_contenders(args) -> dict:
    """name -> (run(), new tokens, weight bytes, prefill-only run or None)."""
    torch.manual_seed(0)
    config = TransformerConfig.from_name("gpt2-124m")
    ids = torch.randint(0, config.vocab_size, (1, args.prompt))
    n = args.new_tokens
    out = {}
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        hf = GPT2LMHeadModel(GPT2Config()).eval()
        mask = torch.ones_like(ids)

        def hf_run(k=n):
            with torch.no_grad():
                hf.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                            pad_token_id=0)
        same_shape = weight_bytes(DecoderLM(config))      # HF's Conv1D layers hold the same matrices
        out["HF transformers fp32"] = (hf_run, n, same_shape, lambda: hf_run(1))
    except ImportError:
        print("transformers is not installed: no HF row", file=sys.stderr)
    for precision in args.precisions:
        plain = precision.endswith("-linear")      # the default F.linear kernels, for comparison
        model = set_precision(DecoderLM(config).eval(), precision.removesuffix("-linear"), decode_kernels=not plain)
        out[f"tformer {precision}"] = (
            lambda m=model: generate(m, ids, n, temperature=0), n, weight_bytes(model),
            lambda m=model: generate(m, ids, 1, temperature=0))
    model = DecoderLM(config).eval()
    out["tformer no cache"] = (lambda: generate(model, ids, args.nocache_tokens, temperature=0, use_cache=False),
                               args.nocache_tokens, weight_bytes(model), None)
    return out


def run_contenders(contenders: dict, repeats: int, bandwidth: float) -> list[dict]:
    """Alternate the contenders ``repeats`` times; medians of end-to-end and decode-only tokens/s."""
    for name, (run, *_rest) in contenders.items():   # warm-up: first-call allocations, lazy init
        if name != "tformer no cache":
            run()
    times = {name: [] for name in contenders}
    prefill = {name: [] for name in contenders}
    for r in range(repeats):
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
            row["decode"] = (n - 1) / max(total - statistics.median(prefill[name]), 1e-9)
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
    p.add_argument("--precisions", nargs="+", default=["fp32", "fp32-linear", "bf16", "bf16-linear", "fp16", "int8"])
    p.add_argument("--nanogpt-tokens", type=int, default=500)
    p.add_argument("--nanogpt-repeats", type=int, default=3)
    p.add_argument("--positions", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    p.add_argument("--skip", nargs="*", default=[], choices=["gpt2", "nanogpt", "latency", "accuracy"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lines = [f"# Generation benchmark\n",
             f"torch {torch.__version__}, {args.threads} threads; at the start {load_note(busy_cores())}"]
    print(lines[-1], file=sys.stderr)
    bandwidth = read_bandwidth()
    lines.append(f"measured read bandwidth (x.sum() over 512 MB, best of 9): {bandwidth:.1f} GB/s\n")
    print(lines[-1], file=sys.stderr)

    if "gpt2" not in args.skip:
        rows = run_contenders(gpt2_contenders(args), args.repeats, bandwidth)
        hf = next((r["e2e"] for r in rows if r["name"].startswith("HF")), None)
        lines += [f"## GPT-2 124M shape (random weights), batch 1, prompt {args.prompt}, {args.new_tokens} new tokens, "
                  f"greedy, median of {args.repeats} (no cache: {args.nocache_tokens} new tokens, 1 run)\n",
                  "| contender | weights MB | end-to-end tok/s | decode tok/s | x HF (e2e) | roofline (decode) | kernel |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            kernel = KERNELS.get(r["name"].replace("tformer ", ""), "HF GPT2 Conv1D: torch.addmm")
            ratio = f"{r['e2e'] / hf:.2f}" if hf else "-"
            dec = f"{r['decode']:.1f}" if "decode" in r else "-"
            lines.append(f"| {r['name']} | {r['bytes'] / 1e6:.0f} | {r['e2e']:.1f} | {dec} | {ratio} | "
                         f"{r['roofline']:.0%} | {kernel} |")
        lines.append("")
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
        RESULTS.mkdir(parents=True, exist_ok=True)
        plot(curve, RESULTS / "generate_latency.png")
        lines += ["## Per-token latency against context position (GPT-2 124M fp32), ms\n",
                  "| position | " + " | ".join(map(str, curve["positions"])) + " |",
                  "|---|" + "---:|" * len(curve["positions"]),
                  "| KV cache | " + " | ".join(f"{t * 1e3:.1f}" for t in curve["cached"]) + " |",
                  "| no cache | " + " | ".join(f"{t * 1e3:.1f}" for t in curve["uncached"]) + " |",
                  "", "![latency](generate_latency.png)", ""]
    lines.append(f"At the end: {load_note(busy_cores())}.")
    print(save(lines))


def save(lines: list[str]) -> str:
    """Write what is measured so far to results/generate.md (a crash later keeps it)."""
    text = "\n".join(lines)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "generate.md").write_text(text + "\n", encoding="utf-8")
    return text


if __name__ == "__main__":
    main()
