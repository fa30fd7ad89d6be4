"""What a write does to the path it is given (issue 49, item 6): a symlink is written through to its target,
atomically, and the link stays; a FIFO, a device or a socket is refused and left as it was, never replaced by
a plain file (as root, ``/save /dev/null`` in ``tformer chat`` would have replaced ``/dev/null``)."""

from __future__ import annotations

import json
import os
import socket
import stat
from types import SimpleNamespace

import pytest

from tformer.errors import InputError
from tformer.io import atomic_write_json


def test_a_symlink_is_written_through_to_its_target(tmp_path):
    (tmp_path / "data").mkdir()
    target = tmp_path / "data" / "target.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_write_json(link, {"a": 1})
    assert link.is_symlink() and os.readlink(link) == str(target)       # the link stays a link
    assert json.loads(target.read_text()) == {"a": 1}                     # and its target has the data
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["target.json"]   # no temporary left


def test_a_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "link.json"
    link.symlink_to("new.json")                                           # relative, not there yet
    atomic_write_json(link, [1])
    assert link.is_symlink() and json.loads((tmp_path / "new.json").read_text()) == [1]


def test_a_fifo_is_refused_and_left_as_it_was(tmp_path):
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="is a FIFO, not a regular file"):
        atomic_write_json(fifo, {"a": 1})
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_a_symlink_to_a_fifo_is_refused(tmp_path):
    os.mkfifo(tmp_path / "f")
    (tmp_path / "link").symlink_to(tmp_path / "f")
    with pytest.raises(InputError, match="points to"):
        atomic_write_json(tmp_path / "link", {})
    assert stat.S_ISFIFO(os.lstat(tmp_path / "f").st_mode) and (tmp_path / "link").is_symlink()


def test_a_socket_and_a_folder_are_refused(tmp_path):
    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        with pytest.raises(InputError, match="is a socket"):
            atomic_write_json(path, {})
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
    with pytest.raises(IsADirectoryError):
        atomic_write_json(tmp_path, {})


def test_a_device_is_refused(tmp_path):
    """Through a link, so that nothing is written near /dev even where the refusal were missing."""
    (tmp_path / "null").symlink_to(os.devnull)
    with pytest.raises(InputError, match="is a character device"):
        atomic_write_json(tmp_path / "null", {})
    assert os.readlink(tmp_path / "null") == os.devnull                 # the link was left as it was


def test_chat_save_refuses_a_fifo_and_writes_through_a_link(tmp_path, monkeypatch, capsys):
    """``/save`` as typed in ``tformer chat``: one line for the FIFO, the link's target saved."""
    from tformer.commands import chat as chat_mod

    os.mkfifo(tmp_path / "f")
    (tmp_path / "target.json").write_text("{}")
    (tmp_path / "link.json").symlink_to(tmp_path / "target.json")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    fake = SimpleNamespace(messages=messages, opened=SimpleNamespace(name="m", dtype="fp32", path="eager", seconds=0.0))
    fake.save = lambda path: chat_mod.Chat.save(fake, path)
    typed = iter([f"/save {tmp_path / 'f'}", f"/save {tmp_path / 'link.json'}"])

    def read(prompt=""):
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None
    monkeypatch.setattr("builtins.input", read)
    assert chat_mod.interact(fake) == 0
    out = capsys.readouterr().out
    assert "cannot save to" in out and "FIFO" in out, out
    assert stat.S_ISFIFO(os.lstat(tmp_path / "f").st_mode)
    assert (tmp_path / "link.json").is_symlink()
    assert json.loads((tmp_path / "target.json").read_text())["messages"] == messages
