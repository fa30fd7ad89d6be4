"""`tformer serve` through the official `openai` client against a real server on 127.0.0.1.

References: tformer.generation.text.generate_text (the single-request KV-cached path, not the
server's pool) for greedy text; a full forward of the model without any cache for logprobs
(tolerance 1e-4); SentenceEncoder called directly for embeddings (1e-6, after base64 on the wire).
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
import torch

from serve_util import tiny_checkpoint, tiny_server
from tformer.generation.text import generate_text
from tformer.serve.openai_api import chat_prompt


@pytest.fixture(scope="module")
def served(tmp_path_factory, one_thread):
    with tiny_server(tmp_path_factory.mktemp("ckpt"), slots=4, timeout=30) as served:
        yield served


def test_models_health_metrics(served):
    _, _, server, running, client = served
    assert [m.id for m in client.models.list().data][0] == server.name
    assert httpx.get(running.url + "/health").json()["status"] == "ok"
    text = httpx.get(running.url + "/metrics").text
    assert "tformer_pool_slots_total 4" in text and "# TYPE tformer_queue_length gauge" in text


def test_completion_equals_generate(served):
    model, tok, server, _, client = served
    out = client.completions.create(model=server.name, prompt="def f(x):", max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == generate_text(model, tok, "def f(x):", 12, temperature=0)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (9, 12, 21)
    echoed = client.completions.create(model=server.name, prompt="def f(x):", max_tokens=12, temperature=0, echo=True)
    assert echoed.choices[0].text == "def f(x):" + out.choices[0].text


def test_chat_equals_generate_on_the_joined_messages(served):
    model, tok, server, _, client = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    out = client.chat.completions.create(model=server.name, messages=messages, max_tokens=8, temperature=0)
    prompt = chat_prompt(messages)
    assert prompt == "Be brief.\nSay hi\n"
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == generate_text(model, tok, prompt, 8, temperature=0)
    assert out.usage.prompt_tokens == len(tok.encode(prompt))


def test_streams_match_full_responses(served):
    _, _, server, running, client = served
    full = client.completions.create(model=server.name, prompt="abc", max_tokens=10, temperature=0).choices[0].text
    chunks = list(client.completions.create(model=server.name, prompt="abc", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    chat = list(client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "abc"}],
                                               max_tokens=6, temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant" and chat[-1].choices[0].finish_reason == "length"
    assert chat[0].object == "chat.completion.chunk"
    # the raw wire: SSE events, the last one [DONE]
    body = {"model": server.name, "prompt": "abc", "max_tokens": 3, "stream": True}
    raw = httpx.post(running.url + "/v1/completions", json=body).text
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["choices"][0]["finish_reason"] is None


def test_stop_string_cuts_the_text(served):
    model, tok, server, _, client = served
    prompt = "The cat sat"
    text = generate_text(model, tok, prompt, 20, temperature=0)
    stop = text[3:5]                       # occurs in the greedy continuation
    cut = text[:text.find(stop)]
    out = client.completions.create(model=server.name, prompt=prompt, max_tokens=20, temperature=0, stop=[stop])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=server.name, prompt=prompt, max_tokens=20, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_n_choices_and_seed(served):
    _, _, server, _, client = served
    args = dict(model=server.name, prompt="x = ", max_tokens=15, temperature=1.0, n=3, seed=7)
    a, b = client.completions.create(**args), client.completions.create(**args)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]            # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1                                  # each choice its own seed
    assert a.usage.completion_tokens == 45 and a.usage.prompt_tokens == 4
    streamed = list(client.completions.create(**args, stream=True))
    texts = ["".join(c.choices[0].text for c in streamed if c.choices[0].index == i) for i in range(3)]
    assert texts == [c.text for c in a.choices]


def test_logprobs_equal_a_full_forward(served):
    model, tok, server, _, client = served
    out = client.completions.create(model=server.name, prompt="if x", max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    ids = torch.tensor([tok.encode("if x" + out.choices[0].text)])
    with torch.no_grad():
        ref = torch.log_softmax(model(ids)[0][0].float(), dim=-1)                   # (T, vocab), no cache
    for k, (s, value, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
        row = ref[len("if x") - 1 + k]
        assert value == pytest.approx(float(row[tok.encode(s)[0]]), abs=1e-4)
        assert len(top) == 3 and max(top.values()) == pytest.approx(float(row.max()), abs=1e-4)
    chat = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "if x"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 3 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)


def test_embeddings_match_the_encoder(served):
    _, _, server, _, client = served
    from tformer.interop.sentence import SentenceEncoder, minilm_path

    texts = ["A man plays a guitar.", "Someone strums a guitar.", "Stock prices fell."]
    out = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)       # the client asks for base64
    got = np.array([d.embedding for d in out.data])
    ref = SentenceEncoder(minilm_path()).encode(texts).numpy()
    np.testing.assert_allclose(got, ref, atol=1e-6)
    assert out.usage.prompt_tokens > len(texts)
    floats = client.embeddings.create(model="all-MiniLM-L6-v2", input="hello", encoding_format="float")
    assert len(floats.data[0].embedding) == 384
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="hello")


def test_embeddings_of_token_ids(served):
    """OpenAI accepts input as token ids (one list or several): fed to the encoder as given, so the
    ids of a text (with its [CLS]/[SEP]) embed as the text does (1e-6, float32 on both sides)."""
    _, _, server, _, client = served
    from tformer.interop.sentence import SentenceEncoder, minilm_path

    encoder = SentenceEncoder(minilm_path())
    texts = ["A man plays a guitar.", "Stock prices fell."]
    ids = encoder.tokenize(texts)
    ref = encoder.encode(texts).numpy()
    out = client.embeddings.create(model="all-MiniLM-L6-v2", input=ids, encoding_format="float")
    np.testing.assert_allclose(np.array([d.embedding for d in out.data]), ref, atol=1e-6)
    one = client.embeddings.create(model="all-MiniLM-L6-v2", input=ids[0], encoding_format="float")
    np.testing.assert_allclose(np.array(one.data[0].embedding), ref[0], atol=1e-6)
    assert one.usage.prompt_tokens == len(ids[0])
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="all-MiniLM-L6-v2", input=[[10**7]])


def test_errors_have_openai_shape_and_status(served):
    _, _, server, running, client = served
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="a", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.name, prompt="a", max_tokens=10**9)
    assert e.value.body["param"] == "max_tokens" and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.name, prompt="a" * 200, max_tokens=1)      # past the context
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=server.name, messages=[], max_tokens=1)
    url = running.url + "/v1/completions"
    cases = [(b"{not json", 400), (b"[1, 2]", 400),
             (json.dumps({"model": server.name, "prompt": "a", "max_tokens": "many"}).encode(), 400),
             (json.dumps({"model": server.name, "prompt": 5}).encode(), 400),
             (json.dumps({"model": server.name, "prompt": "a", "temperature": 9}).encode(), 400),
             (json.dumps({"model": server.name, "prompt": "a", "logit_bias": {"x": 5}}).encode(), 400),
             (json.dumps({"model": server.name, "prompt": "a", "logit_bias": {"1": 500}}).encode(), 400),
             (json.dumps({"model": server.name, "prompt": "a", "logit_bias": {"99999": 1}}).encode(), 400),
             (json.dumps({"model": server.name, "prompt": [10**6]}).encode(), 400),
             (json.dumps({"model": server.name, "prompt": "a" * 1_000_000}).encode(), 413)]
    for body, status in cases:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (body[:40], r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    r = httpx.get(running.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(running.url + "/health").json()["free_slots"] == 4


def test_inspect_attention_and_attribution(served):
    """Attention rows are the last query's rows of attention_maps; each attribution score times its
    normaliser is |d/de log p(target | context; e_i -> (1+e) e_i)| at e = 0, checked by a central
    finite difference in float64 (relative 1e-5)."""
    model, tok, server, running, _ = served
    from tformer.serve.inspect import explain

    r = httpx.post(running.url + "/v1/inspect", json={"prompt": "ab c", "token_ids": [5, 9, 11], "index": 2})
    data = r.json()
    c = model.config
    assert (data["n_layers"], data["n_heads"]) == (c.n_layers, c.n_heads)
    assert np.array(data["attention"]).shape == (c.n_layers, c.n_heads, 6)
    np.testing.assert_allclose(np.array(data["attention"]).sum(-1), 1.0, atol=1e-5)
    assert data["tokens"] == list("ab c") + [tok.decode([5]), tok.decode([9])]

    m64 = __import__("copy").deepcopy(model).double()
    context = tok.encode("ab c") + [5, 9]
    got = explain(m64, tok, context, 11)
    ids = torch.tensor([context])

    def logp(i: int, eps: float) -> float:
        h = m64.tok_emb.register_forward_hook(lambda _m, _i, out: out.index_put(
            (torch.tensor([0]), torch.tensor([i])), out[0, i] * (1 + eps)))
        with torch.no_grad():
            value = torch.log_softmax(m64(ids)[0][0, -1], dim=-1)[11].item()
        h.remove()
        return value
    fd = np.array([abs(logp(i, 1e-6) - logp(i, -1e-6)) / 2e-6 for i in range(len(context))])
    np.testing.assert_allclose(got["attribution"], fd / fd.sum(), rtol=1e-5)
    assert got["logprob"] == pytest.approx(logp(0, 0.0), abs=1e-6)          # reported in float32


def test_inspect_logit_lens_and_head_ablation(served):
    """The lens's last row is the model's own prediction (p = exp(logprob), 1e-5); ablating head
    (1, 2) equals zeroing its columns of W_O (log p within 1e-5); a head outside the model is a 400."""
    model, tok, server, running, _ = served
    body = {"prompt": "ab c", "token_ids": [5, 9, 11], "index": 2}
    data = httpx.post(running.url + "/v1/inspect", json={**body, "ablate": [[1, 2]]}).json()
    c = model.config
    assert len(data["logit_lens"]) == c.n_layers + 1
    last = data["logit_lens"][-1]
    assert last["p_target"] == pytest.approx(float(np.exp(data["logprob"])), abs=1e-5)
    assert all(0 <= row["p_target"] <= row["p_top"] + 1e-7 for row in data["logit_lens"])
    m = __import__("copy").deepcopy(model)
    hs = c.head_dim
    with torch.no_grad():
        m.blocks[1].attn.out_proj.weight[:, 2 * hs:3 * hs] = 0
        edited = torch.log_softmax(m(torch.tensor([tok.encode("ab c") + [5, 9]]))[0][0, -1].float(), -1)[11].item()
    assert data["ablation"]["heads"] == [[1, 2]]
    assert data["ablation"]["logprob"] == pytest.approx(edited, abs=1e-5)
    assert abs(data["ablation"]["logprob"] - data["logprob"]) > 1e-6          # the head mattered a little at least
    bad = httpx.post(running.url + "/v1/inspect", json={**body, "ablate": [[c.n_layers, 0]]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ablate"


def test_cli_serve(tmp_path, one_thread, monkeypatch, capsys):
    """`tformer serve` without a run says in one line how to get one; with a run it serves (a subprocess)."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    import tformer
    from serve_util import free_port
    from tformer.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "make train" in err
    tiny_checkpoint(tmp_path / "runs" / "tiny-1")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(tformer.__file__).parents[1])}   # this checkout's tformer
    proc = subprocess.Popen([sys.executable, "-m", "tformer.cli", "serve", "--port", str(port), "--threads", "1"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
                time.sleep(0.2)
        assert health["model"] == "tiny-1"                   # the newest run under runs/
        out = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                         json={"model": "tiny-1", "prompt": "ab", "max_tokens": 3}).json()
        assert out["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=20)
