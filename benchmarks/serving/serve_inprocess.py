"""Where `tformer serve`'s 1-stream gap is NOT: the scheduler against plain generation, in one process.

GPT-2 124M's shape (random weights, seed 0), 16 prompt tokens, greedy, 2 torch threads, alternating
rounds, medians. Three ways to generate the same tokens: ``plain`` (tformer.generation.generate),
``served`` (a Sequence through the continuous-batching Scheduler, its thread, pool and token choice;
no HTTP), ``raw_pool`` (KVPool.prefill then KVPool.decode, the static slot step, in a bare loop).
Success criterion, set before the run: if ``served`` keeps >= 0.95 of ``plain``, the scheduler, the
static slot step and the token choice are not where the HTTP server's ~0.72 goes.

    flock /tmp/tformer-bench.lock env PYTHONPATH=src python benchmarks/serving/serve_inprocess.py 12 24 4 [--prof]

Arguments: layers, new tokens, rounds. ``--prof`` prints torch.profiler tables of one raw_pool and one plain run.
Writes benchmarks/results/serving/serve_inprocess.md (the tok/s table; the profiles are printed only).
"""
import sys, time, statistics, threading
from pathlib import Path
import torch
torch.set_num_threads(2)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # benchmarks/, for common/
from common.record import Run, results_dir
record = Run()
from tformer.config import TransformerConfig, PRESETS
from tformer.models.decoder import DecoderLM
from tformer.generation.generate import generate
from tformer.serve.scheduler import Scheduler, Sequence, Params, Token
from tformer.serve.pool import KVPool

torch.manual_seed(0)
L = int(sys.argv[1]) if len(sys.argv) > 1 else 12
N = int(sys.argv[2]) if len(sys.argv) > 2 else 48
cfg = TransformerConfig(**{**PRESETS["gpt2-124m"], "n_layers": L})
model = DecoderLM(cfg).eval()
class Tok:
    def decode(self, ids): return " ".join(f"w{i}" for i in ids)
tok = Tok()
prompt = list(range(1, 17))
ids = torch.tensor([prompt])

def plain():
    with torch.inference_mode():
        generate(model, ids, N, temperature=0)

sched = Scheduler(model, n_slots=16)
def served():
    done = threading.Event()
    def emit(e):
        if not isinstance(e, Token): done.set()
    sched.submit(Sequence(prompt, Params(N, temperature=0.0), emit, tok, stop_ids=frozenset({50256})))
    done.wait()

pool = KVPool(model, 16, cfg.context_length)
def raw():
    logits = pool.prefill([0], [prompt])
    t = logits.argmax(-1)
    for i in range(N - 1):
        logits = pool.decode(t, len(prompt) + i + 1)
        t = logits.argmax(-1)
        t.tolist()
    pool.release(0)

runs = {"plain": plain, "served": served, "raw_pool": raw}
for f in runs.values(): f()
times = {n: [] for n in runs}
for r in range(int(sys.argv[3]) if len(sys.argv) > 3 else 3):
    for n, f in (list(runs.items()) if r % 2 == 0 else list(reversed(runs.items()))):
        t = time.perf_counter(); f(); times[n].append(time.perf_counter() - t)
table = [f"# The scheduler against plain generation, in one process (GPT-2 shape, {L} layers, 16 prompt tokens, "
         f"{N} new, greedy, 2 threads)", "", f"Medians of {len(times['plain'])} alternated rounds.", "",
         "| path | tok/s | ms/token |", "|---|---:|---:|"]
for n, ts in times.items():
    m = statistics.median(ts)
    print(f"{n}: {N/m:.1f} tok/s, {1000*m/N:.2f} ms/token")
    table.append(f"| {n} | {N/m:.1f} | {1000*m/N:.2f} |")
record.write(results_dir("serving") / "serve_inprocess.md", "\n".join(table) + "\n")
if "--prof" in sys.argv:
    import torch.autograd.profiler as P
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        raw()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        plain()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
sched.close()
