"""One front door: ``tformer chat``, ``tformer generate`` and ``tformer serve`` open a model through the one
loader (:func:`tformer.inference.open_model`), so at temperature 0 they answer one prompt with the same tokens
at every weight format, and they stop at the same token, the chat template's end-of-turn, even for a
checkpoint whose end-of-sequence id is another token.
"""

from __future__ import annotations

import io
import json
import shutil

import httpx
import pytest

from serve_util import Running
from tformer.cli import main
from tformer.inference import open_model
from tformer.serve.app import build_app
from tformer.serve.build import build_server

PROMPT = "Name three colours."
N = 24


def served_answer(spec: str, dtype: str, messages: list[dict], max_tokens: int) -> dict:
    server = build_server(spec, slots=1, dtype=dtype, max_model_len=256)
    running = Running(build_app(server))
    try:
        r = httpx.post(running.url + "/v1/chat/completions", timeout=300,
                       json={"model": server.name, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]
    finally:
        running.stop()
        server.close()


@pytest.mark.parametrize("dtype", ["auto", "fp32", "q8_0"])
def test_chat_generate_and_serve_answer_alike(smollm2, dtype, capsys):
    opened = open_model("smollm2", dtype)
    assert opened.dtype == ("q4_1" if dtype == "auto" else dtype)
    messages = [{"role": "user", "content": PROMPT}]
    common = ["--model", "smollm2", "--temperature", "0", "--max-new-tokens", str(N), "--dtype", dtype]
    assert main(["chat", "--prompt", PROMPT, *common]) == 0
    chat = capsys.readouterr().out.removesuffix("\n")
    rendered = opened.template.render(messages)              # generate continues the same rendered prompt
    assert main(["generate", "--prompt", rendered, *common]) == 0
    generated = capsys.readouterr().out.removesuffix("\n")
    served = served_answer("smollm2", dtype, messages, N)["message"]["content"]
    assert chat and chat == generated == served, (chat, generated, served)


def test_chat_and_serve_stop_at_the_end_of_turn_when_eos_is_another_token(smollm2, tmp_path):
    """A checkpoint whose eos is ``<|endoftext|>`` (0) while its template ends turns with ``<|im_end|>`` (2):
    chat used to stop at eos only and ran on past the end of its turn; now both stop at 2."""
    from tformer.commands.chat import Chat

    _, folder = smollm2
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in folder.iterdir():
        (ckpt / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, ckpt / f.name)
    meta = json.loads((ckpt / "tformer_config.json").read_text(encoding="utf-8"))
    meta["generation"] = {"eos_token_id": [0]}
    (ckpt / "tformer_config.json").write_text(json.dumps(meta), encoding="utf-8")

    opened = open_model(ckpt)
    assert opened.stop_ids == [0, 2]                      # eos and the template's end-of-turn
    chat = Chat(opened, None, {"temperature": 0.0}, max_new_tokens=60)
    out = io.StringIO()
    r = chat.answer("Say hello in one short sentence.", out)
    assert r["tokens"] < 60 and "<|im_end|>" not in out.getvalue()    # it ended its turn
    choice = served_answer(str(ckpt), "auto", [{"role": "user", "content": "Say hello in one short sentence."}], 60)
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == chat.messages[-1]["content"]


def test_a_gguf_opens_from_the_file_with_nothing_converted(smollm2, monkeypatch, capsys):
    """Chatting with a GGUF reads it as it is: the float conversion (what `tformer convert` and
    `resolve_model` write into the cache) is never called."""
    import tformer.interop.builtin as builtin
    import tformer.interop.gguf_import as gguf_import

    def refuse(*args, **kwargs):
        raise AssertionError("a float checkpoint was written")

    monkeypatch.setattr(builtin, "cached_conversion", refuse)
    monkeypatch.setattr(gguf_import, "convert_gguf", refuse)
    assert main(["chat", "--prompt", "Hi", "--max-new-tokens", "2", "--temperature", "0", "--verbose"]) == 0
    err = capsys.readouterr().err
    assert "weights q4_1 (auto: the file's own q4_1 blocks" in err, err
    assert "whole-layer path (whole layers in one C++ call" in err, err


def test_a_context_of_2_to_the_40_is_sized_without_allocating_it(tmp_path):
    """A model whose metadata claims a huge context (a GGUF's context_length = 2**40): the server sizes a
    slot from two tiny states instead of allocating one of 2**40 positions, and says how to fit it."""
    from tformer import DecoderLM, TransformerConfig
    from tformer.checkpoint import save_model
    from tformer.errors import ConfigError
    from tformer.tokenizers import CharTokenizer

    tok = CharTokenizer(list("abcdefgh "))
    config = TransformerConfig(vocab_size=tok.vocab_size, n_heads=2, n_layers=1, d_model=32, d_ff=64,
                               positions="rope", context_length=2**40)
    save_model(tmp_path, DecoderLM(config).eval())
    tok.save(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match="--max-model-len"):
        build_server(str(tmp_path), slots=1)
    server = build_server(str(tmp_path), slots=1, max_model_len=64)
    server.close()


def test_kept_blocks_are_the_files_pages_and_the_collector_comes_back(smollm2, tmp_path):
    """A GGUF's kept blocks are views of the mapped file (no copy of its bytes); the garbage collector,
    paused while a model opens, is on again afterwards, also when opening fails."""
    import gc

    from tformer.errors import CheckpointError
    from tformer.quant.block_linear import BlockLinear

    opened = open_model("smollm2")
    # a feed-forward matrix: the attention's q, k and v are stacked into one matrix, a copy
    lin = next(m for n, m in opened.model.named_modules() if isinstance(m, BlockLinear) and n.endswith("ffn.down"))

    def mapping_of(address: int) -> str:                       # the file (or "") a process address lies in
        for line in open("/proc/self/maps"):
            span, *rest = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return rest[-1].strip() if len(rest) == 5 else ""
        return ""

    assert mapping_of(lin.blocks.data_ptr()) == str(opened.source.resolve())
    assert gc.isenabled()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 8)
    with pytest.raises(CheckpointError):
        open_model(str(bad))
    assert gc.isenabled()
