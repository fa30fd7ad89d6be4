"""The GGUF conversion cache (``tformer.interop.builtin.cached_conversion``, issue 49 items 5 and 25):
a killed conversion's staging folder is removed by the next start (never a live process's), and a
damaged cached folder is verified, converted again once and named, not handed to a loader that then
says "retrain or restore it"."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="the optional extra 'gguf' is not installed")
pytest.importorskip("tokenizers")

import tformer  # noqa: E402
from tformer.checkpoint import load_model  # noqa: E402
from tformer.errors import CheckpointError  # noqa: E402
from tformer.interop import builtin  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_gguf_malformed import base_kv, base_tensors, gguf_bytes  # noqa: E402

SRC = str(Path(tformer.__file__).resolve().parents[1])

# a conversion killed midway: the staging folder exists and holds part of the model
KILLED = """
import sys, time
from pathlib import Path
from tformer.interop import builtin, gguf_import
def slow(path, out):
    (Path(out) / "model.safetensors").write_bytes(b"half")
    print("converting", flush=True)
    time.sleep(600)
gguf_import.convert_gguf = slow
builtin.cached_conversion(Path(sys.argv[1]))
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path / "cache"))
    (tmp_path / "m.gguf").write_bytes(gguf_bytes(base_kv(), base_tensors()))
    return tmp_path / "m.gguf", tmp_path / "cache" / "gguf"


def start_killed_conversion(path: Path, cache_dir: Path) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", KILLED, str(path)], text=True, stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": SRC, "TFORMER_CACHE": str(cache_dir.parent)})
    assert child.stdout.readline().strip() == "converting"
    return child


def test_a_killed_conversion_leaves_no_staging_folder_after_the_next_start(cache):
    path, folder = cache
    child = start_killed_conversion(path, folder)
    child.kill()                                   # kill -9 in the middle of the conversion
    child.wait()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")], "the killed conversion left no stage"
    target = builtin.cached_conversion(path)
    assert load_model(target) is not None
    assert [p.name for p in folder.iterdir()] == [target.name]


def test_a_live_conversion_s_staging_folder_is_left_alone(cache):
    path, folder = cache
    child = start_killed_conversion(path, folder)
    try:
        (live,) = [p for p in folder.iterdir() if p.name.startswith(".")]
        legacy_old = folder / f".{path.stem}-0123456789abcdef.new-x1y2z3"      # e6cb2db's mkdtemp name
        legacy_young = folder / f".{path.stem}-0123456789abcdef.new-a1b2c3"
        for d in (legacy_old, legacy_young):
            d.mkdir()
        os.utime(legacy_old, (time.time() - 7200, time.time() - 7200))
        builtin.cached_conversion(path)
        assert live.is_dir() and (live / "model.safetensors").is_file()      # its owner is alive
        assert legacy_young.is_dir() and not legacy_old.exists()
    finally:
        child.kill()
        child.wait()
    builtin.remove_stale_stages(folder)
    assert not live.exists()


@pytest.mark.parametrize("damage", ["weights_flipped", "weights_missing", "config_cut", "tokenizer_cut"])
def test_a_damaged_cached_conversion_is_converted_again_and_named(cache, capsys, damage):
    path, _ = cache
    target = builtin.cached_conversion(path)
    if damage == "weights_flipped":
        data = bytearray((target / "model.safetensors").read_bytes())
        data[-100] ^= 0xFF
        (target / "model.safetensors").write_bytes(bytes(data))
    elif damage == "weights_missing":
        (target / "model.safetensors").unlink()
    elif damage == "config_cut":
        (target / "tformer_config.json").write_text('{"model": ', encoding="utf-8")
    elif damage == "tokenizer_cut":
        (target / "tokenizer.json").write_text('{"version"', encoding="utf-8")
    capsys.readouterr()
    again = builtin.cached_conversion(path)
    assert again == target
    assert f"in {target} is damaged" in capsys.readouterr().err
    assert load_model(again) is not None                   # e6cb2db: "... damaged; retrain or restore it"
    from tformer.tokenizers import load_tokenizer

    assert load_tokenizer(again).encode("ab")


def test_a_conversion_still_damaged_after_converting_again_is_refused_naming_the_folder(cache, monkeypatch):
    from tformer.interop import gguf_import

    path, _ = cache
    target = builtin.cached_conversion(path)
    (target / "model.safetensors").write_bytes(b"damaged")
    real = gguf_import.convert_gguf

    def damaging(src, out):
        real(src, out)
        (Path(out) / "model.safetensors").write_bytes(b"a disk that loses writes")

    monkeypatch.setattr(gguf_import, "convert_gguf", damaging)
    with pytest.raises(CheckpointError, match=f"into {target} is damaged right after it was written"):
        builtin.cached_conversion(path)
