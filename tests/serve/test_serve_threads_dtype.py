"""The server's torch work stays on the scheduler's one thread, and `--dtype` takes the GGUF block formats.

Why one thread: each OS thread that runs a torch parallel region gets its own OpenMP team, and once a
process holds more OpenMP workers than cores libgomp stops spinning between regions; a decode step
then ran about half as fast (see :class:`tformer.serve.scheduler.Scheduler`'s ``threads``). So the
scheduler thread sets its own thread count, `tformer serve` loads with one, and embeddings run as
scheduler jobs rather than in a thread pool.

References for the block formats: `tformer.generation.generate.generate` on the same (block-quantised)
model, one sequence, no pool: the served greedy tokens must be identical.
"""

from __future__ import annotations

import threading

import pytest
import torch

from serve_util import run_alone, tiny_checkpoint
from tformer.serve.build import build_server
from tformer.generation.generate import generate
from tformer.quant.block_linear import BlockLinear
from tformer.serve.openai_api import on_model_thread
from tformer.serve.scheduler import Scheduler


def test_the_scheduler_thread_sets_its_own_torch_threads(tmp_path):
    model, _ = tiny_checkpoint(tmp_path)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sched = Scheduler(model, n_slots=1, threads=2)
        try:
            assert sched.run_job(torch.get_num_threads).result(timeout=30) == 2
            assert sched.run_job(threading.current_thread).result(timeout=30) is sched.thread
        finally:
            sched.close()
    finally:
        torch.set_num_threads(before)


def test_model_jobs_run_on_the_scheduler_thread(tmp_path, one_thread):
    import asyncio

    tiny_checkpoint(tmp_path)
    server = build_server(str(tmp_path), slots=1, threads=1)
    try:
        where = asyncio.run(on_model_thread(server, threading.current_thread))
        assert where is server.scheduler.thread and where is not threading.current_thread()
    finally:
        server.close()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_block_dtypes_serve_the_tokens_generate_gives(tmp_path, one_thread, fmt):
    tiny_checkpoint(tmp_path, context=96)                    # d_model 64: every matrix is 2 blocks wide
    server = build_server(str(tmp_path), slots=2, dtype=fmt)
    try:
        model = server.model
        assert sum(isinstance(m, BlockLinear) for m in model.modules()) >= 8
        prompt = server.tokenizer.encode("def f(x):\n  return")
        with torch.inference_mode():
            ref = generate(model, torch.tensor([prompt]), 20, temperature=0)[0, len(prompt):].tolist()
        assert run_alone(server.scheduler, server.tokenizer, prompt, 20, temperature=0.0) == ref
        assert server.metrics.value("tformer_pool_slots_in_use") == 0
    finally:
        server.close()


def test_smollm2_q4_1_is_served_from_the_files_blocks(smollm2, one_thread):
    server = build_server("smollm2", slots=2, dtype="q4_1", max_model_len=512)
    try:
        layers = [m for m in server.model.blocks.modules() if isinstance(m, BlockLinear)]
        assert len(layers) >= 4 * len(server.model.blocks) and {m.fmt for m in layers} == {"q4_1"}   # as in the file
        prompt = server.chat_template.encode(server.tokenizer, [{"role": "user", "content": "Name three colours."}])
        with torch.inference_mode():
            ref = generate(server.model, torch.tensor([prompt]), 12, temperature=0)[0, len(prompt):].tolist()
        assert run_alone(server.scheduler, server.tokenizer, prompt, 12, temperature=0.0) == ref
    finally:
        server.close()


def test_auto_dtype_serves_a_gguf_from_its_own_blocks_and_a_checkpoint_in_fp32(smollm2, tmp_path):
    """`tformer serve`'s default --dtype auto: SmolLM2's Q4_1 file is served from its q4_1 blocks (as
    llama.cpp serves it), a tformer checkpoint in fp32; the command line's default is auto."""
    from tformer.cli import build_parser

    assert build_parser().parse_args(["serve"]).dtype == "auto"
    server = build_server("smollm2", slots=1, dtype="auto", max_model_len=64)
    try:
        assert server.opened.dtype == "q4_1" and "own q4_1 blocks" in server.opened.dtype_reason
        assert isinstance(server.model.blocks[0].ffn.up, BlockLinear)
    finally:
        server.close()
    tiny_checkpoint(tmp_path, context=32)
    server = build_server(str(tmp_path), slots=1, dtype="auto")
    try:
        assert server.opened.dtype == "fp32"
        assert not any(isinstance(m, BlockLinear) for m in server.model.modules())
        assert next(server.model.parameters()).dtype == torch.float32
    finally:
        server.close()
