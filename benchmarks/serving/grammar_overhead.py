"""Which grammar engine constrains tformer serve's structured output: per-token mask overhead of
llguidance against xgrammar on SmolLM2-135M-Instruct's 49,152-token vocabulary.

For each of the three schemas of benchmarks/serving/structured_output.py and json_object (any
object), a fixed schema-valid JSON text is tokenized with SmolLM2's tokenizer and walked token by
token, as the scheduler does: compute the next-token mask (both engines write the same 32-tokens-
per-int32-word bitmask), set a logits row of 49,152 to -inf where it is 0 (the same torch code for
both: tformer.serve.grammar.JSONConstraint's), then feed the token. Timed per token (median and p90
over every token of every round) and, apart, the schema's compilation (median over the rounds; each
engine's cache off) and the vocabulary's (once). Engines alternate within every round. Both engines
must allow every token of the text (checked) and, at the end, only the end-of-turn token.
Criterion, fixed before the run: the engine with the lower median per-token time (mask + apply +
advance) over all four grammars is the server's, unless its schema compilation is over 10x slower
(a request compiles its schema once; it runs tens of mask steps).

    flock -w 900 /tmp/tformer-bench.lock timeout 300 env PYTHONPATH=src python benchmarks/serving/grammar_overhead.py [ROUNDS]

Needs llguidance and xgrammar (xgrammar is installed with --no-deps here: its triton requirement is
only for GPU kernels). Writes benchmarks/results/serving/grammar_overhead.md.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))                    # benchmarks/, for common/
from common.record import Run, results_dir  # noqa: E402

record = Run()
torch.set_num_threads(1)
_spec = importlib.util.spec_from_file_location("structured_output", HERE / "structured_output.py")
structured = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(structured)

from tformer.interop.builtin import resolve_model  # noqa: E402
from tformer.serve.grammar import JSON_OPTIONS, unpack  # noqa: E402
from tformer.tokenizers import load_tokenizer  # noqa: E402

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
V, EOT = 49152, 2
TEXTS = {"person": '{"name": "Ada Lovelace", "age": 36}',
         "verdict": '{"answer": "no", "confident": true}',
         "colors": '{"colors": ["red", "green", "blue"]}',
         "json_object": '{"city": "Paris", "country": "France", "population": 2102650, "capital": true}'}
GRAMMARS = {**{k: v[0] for k, v in structured.SCHEMAS.items()}, "json_object": {"type": "object"}}


def apply(words: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """What the server does with a bitmask (JSONConstraint.mask): ``(V,)`` allowed tokens, -inf
    elsewhere in ``row``."""
    allowed = unpack(words, V)
    row.masked_fill_(~allowed, float("-inf"))
    return allowed


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok):
        import llguidance
        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(tok.tok.to_str(), n_vocab=V, eos_token=[EOT])
        self.version = llguidance.__version__

    def compile(self, schema):
        g = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        m = self.llg.LLMatcher(self.tokenizer, g, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def start(self, compiled):
        self.m, self.words = compiled, torch.empty(V // 32, dtype=torch.int32)

    def mask(self):
        self.m.unsafe_compute_mask_ptr(self.words.data_ptr(), self.words.numel() * 4)
        return self.words

    def advance(self, t):
        assert self.m.consume_token(t)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok):
        import importlib.metadata

        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_object=tok.tok, eos_token="<|im_end|>")
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=V, stop_token_ids=[EOT])
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False, max_threads=1)
        self.version = importlib.metadata.version("xgrammar")

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))

    def start(self, compiled):
        self.m, self.bm = self.xgr.GrammarMatcher(compiled), self.xgr.allocate_token_bitmask(1, V)

    def mask(self):
        self.m.fill_next_token_bitmask(self.bm)
        return self.bm[0]

    def advance(self, t):
        assert self.m.accept_token(t)


def walk(engine, compiled, ids) -> tuple[list[float], list[float]]:
    """Seconds per token over ``ids``: of mask + apply + advance, and of the engine's part alone
    (mask + advance); checks each token is allowed and that only the end-of-turn token is at the end."""
    engine.start(compiled)
    times, own = [], []
    row = torch.zeros(V)
    for t in ids:
        start = time.perf_counter()
        words = engine.mask()
        mid = time.perf_counter()
        allowed = apply(words, row)
        mid2 = time.perf_counter()
        engine.advance(t)
        end = time.perf_counter()
        times.append(end - start)
        own.append((mid - start) + (end - mid2))
        assert allowed[t], (engine.name, t)
        row.zero_()
    allowed = apply(engine.mask(), row)
    assert allowed.nonzero().flatten().tolist() == [EOT], (engine.name, allowed.sum())
    return times, own


def main() -> None:
    tok = load_tokenizer(resolve_model("smollm2"))
    engines, vocab_s = [], {}
    for cls in (LLGuidance, XGrammar):
        start = time.perf_counter()
        engines.append(cls(tok))
        vocab_s[cls.name] = time.perf_counter() - start
    ids = {k: tok.encode(v, add_special_tokens=False) for k, v in TEXTS.items()}
    per_token = {(e.name, g): [] for e in engines for g in GRAMMARS}
    engine_only = {(e.name, g): [] for e in engines for g in GRAMMARS}
    compile_s = {(e.name, g): [] for e in engines for g in GRAMMARS}
    for r in range(ROUNDS):
        for e in (engines if r % 2 == 0 else engines[::-1]):             # alternate which goes first
            for g, schema in GRAMMARS.items():
                start = time.perf_counter()
                compiled = e.compile(schema)
                compile_s[(e.name, g)].append(time.perf_counter() - start)
                total, own = walk(e, compiled, ids[g])
                per_token[(e.name, g)] += total
                engine_only[(e.name, g)] += own
    us = lambda xs: statistics.median(xs) * 1e6                         # noqa: E731
    p90 = lambda xs: sorted(xs)[int(0.9 * (len(xs) - 1))] * 1e6        # noqa: E731
    rows = []
    for g in GRAMMARS:
        a, b = per_token[("llguidance", g)], per_token[("xgrammar", g)]
        ca, cb = compile_s[("llguidance", g)], compile_s[("xgrammar", g)]
        oa, ob = engine_only[("llguidance", g)], engine_only[("xgrammar", g)]
        rows.append(f"| {g} | {len(ids[g])} | {us(a):.0f} | {p90(a):.0f} | {us(oa):.0f} | {us(b):.0f} | {p90(b):.0f} | "
                    f"{us(ob):.0f} | {us(b) / us(a):.2f} | {us(ca) / 1e3:.1f} | {us(cb) / 1e3:.1f} |")
    all_a = [x for g in GRAMMARS for x in per_token[("llguidance", g)]]
    all_b = [x for g in GRAMMARS for x in per_token[("xgrammar", g)]]
    comp_a = statistics.median(x for g in GRAMMARS for x in compile_s[("llguidance", g)])
    comp_b = statistics.median(x for g in GRAMMARS for x in compile_s[("xgrammar", g)])
    faster = "llguidance" if us(all_a) <= us(all_b) else "xgrammar"
    comp_ratio = (comp_a / comp_b) if faster == "llguidance" else (comp_b / comp_a)
    pick = faster if comp_ratio <= 10 else ("xgrammar" if faster == "llguidance" else "llguidance")
    # the bare apply step, the same for both engines (its share of the figures above)
    words = torch.full((V // 32,), -1, dtype=torch.int32)
    row, reps = torch.zeros(V), []
    for _ in range(200):
        start = time.perf_counter()
        apply(words, row)
        reps.append(time.perf_counter() - start)
    text = "\n".join([
        "# Grammar engines for structured output: per-token overhead on SmolLM2's 49,152-token vocabulary", "",
        f"llguidance {engines[0].version} against xgrammar {engines[1].version}, one thread, {ROUNDS} alternating "
        f"rounds. Per token: the next-token bitmask, the same torch code setting a 49,152-logit row to -inf where "
        f"it is 0, and feeding the token (microseconds; median and p90 over every token of every round). "
        f"Compile: the schema's grammar, each engine's cache off (milliseconds, median of the rounds).", "",
        "| grammar | tokens | llguidance µs/token | p90 | of it the engine | xgrammar µs/token | p90 | of it the engine | "
        "xgrammar / llguidance | llguidance compile ms | xgrammar compile ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|", *rows, "",
        f"All grammars: llguidance {us(all_a):.0f} µs/token, xgrammar {us(all_b):.0f} µs/token "
        f"(xgrammar / llguidance {us(all_b) / us(all_a):.2f}); schema compile medians {comp_a * 1e3:.1f} ms and "
        f"{comp_b * 1e3:.1f} ms. The shared apply step alone: {us(reps):.0f} µs. Vocabulary compiled once: "
        f"llguidance {vocab_s['llguidance']:.2f} s, xgrammar {vocab_s['xgrammar']:.2f} s.", "",
        f"Criterion (set before the run): the lower median per-token time wins unless its compile is over 10x "
        f"slower. Pick: **{pick}**.", ""])
    record.finish()
    print(text)
    print(record.write(results_dir("serving") / "grammar_overhead.md", text))


if __name__ == "__main__":
    main()
