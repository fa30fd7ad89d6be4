"""tformer.machine.cpu_info: the model name and instruction sets that every benchmark result records.

References: a hand-written /proc/cpuinfo excerpt (what each flag should turn into), and on this
machine torch's own CPU dispatch level (``torch.backends.cpu.get_cpu_capability``, read by ATen from
CPUID rather than from /proc/cpuinfo) and ``lscpu``'s model name.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from tformer.machine import INSTRUCTION_SETS, cpu_info

SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni avx_vnni avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: something else
flags\t\t: fpu
"""

ZEN3 = """processor\t: 0
model name\t: AMD EPYC 7763 64-Core Processor
flags\t\t: fpu sse2 avx avx2 fma
"""


def test_flags_become_the_named_instruction_sets():
    cpu = cpu_info(SAPPHIRE_RAPIDS)
    assert cpu.model == "Intel(R) Xeon(R) Platinum 8480+"                      # the first processor's
    assert cpu.instruction_sets == ("AVX2", "AVX-512", "AVX512_VNNI", "AVX-VNNI", "AVX512_BF16", "AMX")
    assert str(cpu) == "Intel(R) Xeon(R) Platinum 8480+ (AVX2, AVX-512, AVX512_VNNI, AVX-VNNI, AVX512_BF16, AMX)"
    zen = cpu_info(ZEN3)
    assert zen.instruction_sets == ("AVX2",)
    assert "avx512" not in str(zen).lower()


def test_a_flag_is_matched_whole_not_as_a_prefix():
    cpu = cpu_info("model name : x\nflags : avx512fp16 avx2_something amx_bf16\n")    # none of them is listed
    assert cpu.instruction_sets == ()
    assert str(cpu) == f"x (none of {', '.join(INSTRUCTION_SETS)})"


def test_no_cpuinfo_still_names_a_model():
    assert cpu_info("").model and cpu_info("").instruction_sets == ()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/cpuinfo is Linux's")
def test_this_machine_agrees_with_torch_dispatch_and_lscpu():
    cpu = cpu_info()
    level = torch.backends.cpu.get_cpu_capability()                  # "AVX512", "AVX2", "DEFAULT", ...
    if level == "AVX512":
        assert {"AVX2", "AVX-512"} <= set(cpu.instruction_sets)
    elif level == "AVX2":
        assert "AVX2" in cpu.instruction_sets
    if shutil.which("lscpu"):
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        names = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.lower().startswith("model name")]
        if names:
            assert cpu.model == names[0]


def test_free_cores_counts_other_processes_not_this_one(monkeypatch):
    """FreeCores: /proc/stat's busy ticks less this process's own, over the window since construction."""
    import tformer.machine as machine

    ticks = {"cpu": (1000, 5000), "own": 300}
    monkeypatch.setattr(machine, "_cpu_ticks", lambda: ticks["cpu"])
    monkeypatch.setattr(machine, "_own_ticks", lambda: ticks["own"])
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(machine, "available_cores", lambda: 2)
    free = machine.FreeCores()
    ticks.update(cpu=(1000 + 150, 5000 + 200), own=300 + 50)     # 150 busy ticks of 200, 50 of them ours
    assert free.threads(2) == 1                                   # others: 100 / 200 of 2 cores = 1 core
    ticks.update(cpu=(1000 + 120, 5000 + 200), own=300 + 120)    # all the busy time was this process's
    assert free.threads(2) == 2
    ticks.update(cpu=(1000 + 200, 5000 + 200), own=300)          # both cores taken by others: still 1 thread
    assert free.threads(2) == 1
    ticks.update(cpu=(1000 + 5, 5000 + 10), own=300)             # too short a window to tell: the default
    assert free.threads(2) == 2
    assert free.threads(1) == 1
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 64)      # 200 ticks of 64 cores: 31 ms, too short too
    ticks.update(cpu=(1000 + 150, 5000 + 200), own=300 + 50)
    assert free.threads(2) == 2


def test_own_ticks_count_the_children_this_process_waited_for():
    """A compiler run during a model's load (the kernels' first build) is this process's work, not a busy
    neighbour's: FreeCores must not take threads away for it."""
    import tformer.machine as machine

    before = machine._own_ticks()
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)
    assert machine._own_ticks() - before >= 20                   # 0.3 s of the child's CPU at 100 ticks a second


def test_open_model_without_threads_takes_the_free_cores(monkeypatch):
    """open_model(threads=None) sets torch's threads to what a FreeCores made before the load says, given
    torch's count; with ``threads`` it sets that and asks nothing (the tiles take one thread of their own)."""
    from pathlib import Path

    import tformer.inference as inference

    asked = []

    class Busy:
        def threads(self, default):
            asked.append(default)
            return 1

    monkeypatch.setattr(inference, "FreeCores", Busy)
    gguf = Path(__file__).parent / "data" / "qwen2-tiny-q4_k_m.gguf"
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        inference.open_model(gguf)
        assert asked == [2] and torch.get_num_threads() == 1        # the model's threads
        inference.open_model(gguf, threads=2)
        assert asked == [2] and torch.get_num_threads() == 2        # asked for: nothing measured
    finally:
        torch.set_num_threads(n)


def test_open_model_opens_at_one_thread_and_leaves_the_tiles_to_their_own(monkeypatch):
    """Opening runs at one torch thread (each short copy or check at two would be a parallel region that
    waits for a busy neighbour's time slice); the path is chosen inside it, its tiles left to their own
    thread (``choose_path(..., background=True)``); afterwards the count asked for is back."""
    from pathlib import Path

    import tformer.inference as inference

    seen, choose, parts = [], inference.choose_path, inference._gguf_parts

    def recording(model, background=False):
        seen.append(("path", torch.get_num_threads(), background))
        return choose(model, background)

    def reading(*args):
        seen.append(("read", torch.get_num_threads()))
        return parts(*args)

    monkeypatch.setattr(inference, "choose_path", recording)
    monkeypatch.setattr(inference, "_gguf_parts", reading)
    gguf = Path(__file__).parent / "data" / "qwen2-tiny-q4_k_m.gguf"
    n = torch.get_num_threads()
    try:
        inference.open_model(gguf, threads=2)
        assert seen == [("read", 1), ("path", 1, True)] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(n)
