"""`tformer serve --model smollm2`: /v1/chat/completions renders the model's own chat template (ChatML
for SmolLM2-135M-Instruct) and answers what the same greedy generation on the template's ids answers."""

from __future__ import annotations

import httpx
import torch

from serve_util import Running
from tformer.serve.build import build_server
from tformer.generation.generate import generate
from tformer.serve.app import build_app


def test_chat_completions_use_the_models_chat_template(smollm2):
    server = build_server("smollm2", slots=1)
    assert server.name == "smollm2" and server.chat_template is not None
    running = Running(build_app(server))
    try:
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        r = httpx.post(running.url + "/v1/chat/completions", timeout=300,
                       json={"model": "smollm2", "messages": messages, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
    finally:
        running.stop()
    assert "Paris" in answer, answer
    ids = server.chat_template.encode(server.tokenizer, messages)
    out = generate(server.model, torch.tensor([ids]), 12, temperature=0, stop_tokens=sorted(server.eos))[0, len(ids):]
    want = [t for t in out.tolist() if t not in server.eos]
    assert answer == server.tokenizer.decode(want)
