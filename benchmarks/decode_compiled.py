"""Eager, static and compiled decode in one run, alternated: GPT-2 124M shape, batch 1, prompt 32 + 48
new tokens, greedy, fp32. Says which of the three generation should use by default.

    flock /tmp/tformer-bench.lock env PYTHONPATH=$PWD/src .venv/bin/python benchmarks/decode_compiled.py
"""
import time, statistics, torch
from tformer import DecoderLM, TransformerConfig, generate
torch.manual_seed(0)
m = DecoderLM(TransformerConfig.from_name("gpt2-124m")).eval(); ids = torch.randint(0, 50257, (1, 32))
t = time.perf_counter(); generate(m, ids, 4, temperature=0, compile=True); print(f"first compiled call {time.perf_counter() - t:.1f} s")
generate(m, ids, 4, temperature=0)
res = {"eager": [], "static": [], "compiled": []}
def rate(**kw):
    t0 = time.perf_counter(); generate(m, ids, 1, temperature=0, **kw); pre = time.perf_counter() - t0
    t = time.perf_counter(); generate(m, ids, 49, temperature=0, **kw); return 48 / (time.perf_counter() - t - pre)
for r in range(5):
    for k, kw in (("eager", {}), ("static", {"static": True}), ("compiled", {"compile": True})):
        res[k].append(rate(**kw))
for k, v in res.items():
    print(k, f"median {statistics.median(v):.1f} tok/s, min {min(v):.1f}, max {max(v):.1f}")
print("compiled / eager", statistics.median(res["compiled"]) / statistics.median(res["eager"]))
