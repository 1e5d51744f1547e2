"""Atomic writes: complete or absent under the final name, readable by other users, leftovers cleaned up."""

from __future__ import annotations

import os
import stat

import pytest

from lightning_eagle.atomic import atomic_dir, atomic_file


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_dir_follows_the_umask_not_tempfile_privacy(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "export") as tmp:
            (tmp / "config.json").write_text("{}")
            (tmp / "sub").mkdir()
    finally:
        os.umask(old)
    assert _mode(tmp_path / "export") == 0o755 and _mode(tmp_path / "export" / "sub") == 0o755
    assert _mode(tmp_path / "export" / "config.json") == 0o644  # a serving process of another user can read it


def test_a_failed_write_leaves_the_old_folder_and_no_partial(tmp_path):
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "out", overwrite=True) as tmp:
        (tmp / "a").write_text("new, half written")
        raise RuntimeError("killed")
    assert (tmp_path / "out" / "a").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_atomic_file_replaces_and_cleans_a_crashed_writers_leftover(tmp_path):
    final = tmp_path / "last.ckpt"
    leftover = tmp_path / ".last.ckpt.123-abcdef01.partial"  # what kill -9 during a save leaves
    leftover.write_bytes(b"truncated")
    old = os.umask(0o022)
    try:
        with atomic_file(final) as tmp:
            tmp.write_bytes(b"complete")
    finally:
        os.umask(old)
    assert final.read_bytes() == b"complete" and _mode(final) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_existing_folder_without_overwrite_is_refused_untouched(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    with pytest.raises(FileExistsError, match="out exists; pass overwrite=True"), atomic_dir(tmp_path / "out"):
        pass
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep"]
