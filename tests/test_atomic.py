"""Atomic writes: complete or absent under the final name, readable by other users, leftovers cleaned up."""

from __future__ import annotations

import json
import os
import re
import resource
import stat
from pathlib import Path

import pytest
import torch

from lightning_eagle.atomic import atomic_dir, atomic_file, check_writable, weights_folder_problem
from lightning_eagle.errors import OutputWriteError


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
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "out", overwrite=True, replaceable=lambda f: None) as tmp:
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
    with (
        pytest.raises(FileExistsError, match=r"out exists; pass --overwrite \(overwrite=True\)"),
        atomic_dir(tmp_path / "out"),
    ):
        pass
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep"]


def _weights_folder(folder, architectures=("Eagle3KimiK3ForCausalLM",), extra=()):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": list(architectures)}))
    (folder / "model.safetensors").write_bytes(b"x")
    for name in extra:
        (folder / name).write_text("mine")
    return folder


@pytest.mark.parametrize(
    "architectures, extra, problem",
    [
        (("Eagle3KimiK3ForCausalLM",), (), None),  # a previous export: replaced
        (("Eagle3KimiK3ForCausalLM",), ("notes.txt",), "it holds other files (notes.txt)"),
        (("LlamaForCausalLM",), (), "its config.json names architectures ['LlamaForCausalLM']"),
    ],
)
def test_overwrite_replaces_only_a_previous_write_of_the_same_kind(tmp_path, architectures, extra, problem):
    """The one rule destructive writes share (issue 23: --overwrite deleted a run folder and a user's files)."""
    folder = _weights_folder(tmp_path / "out", architectures, extra)
    before = sorted(p.name for p in folder.iterdir())
    rule = lambda f: weights_folder_problem(f, frozenset({"Eagle3KimiK3ForCausalLM"}))  # noqa: E731
    if problem is None:
        with atomic_dir(folder, overwrite=True, replaceable=rule) as tmp:
            (tmp / "config.json").write_text("{}")
        assert sorted(p.name for p in folder.iterdir()) == ["config.json"]
        return
    with pytest.raises(FileExistsError, match=re.escape(f"refusing to replace {folder}: {problem}")):
        with atomic_dir(folder, overwrite=True, replaceable=rule):
            pass
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing touched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no partial left


def test_a_writer_that_declares_nothing_replaces_nothing(tmp_path):
    folder = _weights_folder(tmp_path / "out")
    with pytest.raises(FileExistsError, match="this writer declares nothing it may replace"):
        with atomic_dir(folder, overwrite=True):
            pass


# A folder the kernel refuses new entries in, whoever asks (root included): sysfs. Linux only, like the library.
REFUSING = Path("/sys/fs")


def test_a_refused_write_names_the_file_and_the_cause(tmp_path):
    with pytest.raises(OutputWriteError, match=re.escape(f"cannot write {REFUSING / 'out.bin'}: permission denied")):
        with atomic_file(REFUSING / "out.bin") as tmp:
            tmp.write_bytes(b"x")
    with pytest.raises(
        OutputWriteError, match=re.escape(f"cannot write {REFUSING / 'export'}: operation not permitted")
    ):
        with atomic_dir(REFUSING / "export") as tmp:
            (tmp / "config.json").write_text("{}")


def test_the_file_size_limit_is_explained_even_when_the_serializer_hides_it(tmp_path):
    """torch.save reports only "unexpected pos"; the partial's size against RLIMIT_FSIZE tells the cause."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        with pytest.raises(OutputWriteError, match="the file-size limit, ulimit -f") as info:
            with atomic_file(tmp_path / "big.pt") as tmp:
                torch.save(torch.zeros(1 << 16), tmp)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert isinstance(info.value.__cause__, RuntimeError)  # the original error is kept, not a cleanup's
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_output_folder_is_probed_before_any_work(tmp_path):
    check_writable(tmp_path / "new" / "deeper", "the export folder")  # creatable: fine, and nothing created
    assert not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputWriteError, match=re.escape(f"{tmp_path / 'file'} exists and is not a folder")):
        check_writable(tmp_path / "file" / "ckpts", "the checkpoint folder")
    with pytest.raises(
        OutputWriteError,
        match=re.escape(
            f"the checkpoint folder {REFUSING / 'ckpts'}: cannot create "
            f"it ({REFUSING} refuses new entries): permission denied"
        ),
    ):
        check_writable(REFUSING / "ckpts", "the checkpoint folder")
    assert list(tmp_path.iterdir()) == [tmp_path / "file"]
