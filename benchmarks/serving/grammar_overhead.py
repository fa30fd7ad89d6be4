"""Which grammar engine constrains tformer serve's structured output: per-token mask overhead of
llguidance against xgrammar on SmolLM2-135M-Instruct's 49,152-token vocabulary.

For each of the three schemas of the structured-output check (tests/serve/structured_util.py) and json_object (any
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
sys.path.insert(0, str(HERE.parents[1] / "tests" / "serve"))          # the schemas of the structured-output check
import structured_util as structured  # noqa: E402

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
        self.xgr = xgr
        # the vocabulary in GPT-2's byte alphabet; control tokens blank, which xgrammar never allows
        # (given as text, "<|im_start|>" would be allowed inside a JSON string: its spelling is valid content)
        vocab = [""] * V
        for token, i in tok.tok.get_vocab(with_added_tokens=True).items():
            vocab[i] = token
        for i, added in tok.tok.get_added_tokens_decoder().items():
            if added.special:
                vocab[i] = ""
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=V, stop_token_ids=[EOT])
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


def walks(engine, schema, text: str, tok) -> bool:
    """Whether ``engine``'s masks let every token of ``text`` through and then the end-of-turn token."""
    engine.start(engine.compile(schema))
    row = torch.zeros(V)
    for t in tok.encode(text, add_special_tokens=False):
        if not apply(engine.mask(), row)[t]:
            return False
        engine.advance(t)
        row.zero_()
    return bool(apply(engine.mask(), row)[EOT])


# Validity: texts that are NOT JSON (json.loads refuses each) yet a careless string grammar takes:
# raw control characters in a string (RFC 8259 section 7 wants them escaped) and a lone backslash.
INVALID = {"raw U+0001 in a string": '{"name": "B\u0001ob", "age": 42}',
           "raw tab in a string": '{"name": "B\tob", "age": 42}',
           "raw newline in a string": '{"name": "B\nob", "age": 42}'}


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
    validity = []
    for what, text in INVALID.items():
        try:
            json.loads(text)
            raise AssertionError(f"{what}: json.loads takes it, so it is no test of validity")
        except ValueError:
            pass
        took = [e.name for e in engines if walks(e, GRAMMARS["person"], text, tok)]
        validity.append(f"| {what} | {', '.join(took) or 'neither'} |")
    wrong = {e.name for e in engines if any(walks(e, GRAMMARS["person"], t, tok) for t in INVALID.values())}
    valid_pick = pick if pick not in wrong else next((e.name for e in engines if e.name not in wrong), "neither")
    # the apply step (the same torch code for both engines), timed inside the walks: total - own
    applied = [t - o for key in per_token for t, o in zip(per_token[key], engine_only[key])]
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
        f"{comp_b * 1e3:.1f} ms. Of it the shared apply step (unpack the bitmask, -inf fill): median {us(applied):.0f} µs. Vocabulary compiled once: "
        f"llguidance {vocab_s['llguidance']:.2f} s, xgrammar {vocab_s['xgrammar']:.2f} s.", "",
        f"Criterion (set before the run): the lower median per-token time wins unless its compile is over 10x "
        f"slower. By speed: **{pick}**.", "",
        "Validity (added after the first runs, when a cross-check of the two engines' masks token by token "
        "showed them differ inside strings): texts json.loads refuses, walked through the `person` schema's "
        "masks. An engine that lets one through can emit invalid JSON, which disqualifies it whatever its speed.",
        "", "| invalid text | engines whose mask takes it to the end-of-turn token |", "|---|---|", *validity, "",
        f"Pick, fast among the valid: **{valid_pick}**.", ""])
    record.finish()
    print(text)
    print(record.write(results_dir("serving") / "grammar_overhead.md", text))


if __name__ == "__main__":
    main()
