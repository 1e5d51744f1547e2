"""Issue 39, "Nothing silent": run configs read strictly, and the run claim on every output folder.

Configs: a syntax error, an unknown tag, a duplicate key at any depth, an alias bomb, a recursive alias, an empty
file or one that is not a mapping is one ``error:`` line naming the file (and line), exit status 2 like jsonargparse's
own config errors, nothing written. The claim: no ``flock`` on the file system is refused by name (with the opt-in
lock-file fallback, ``LIGHTNING_EAGLE_RUN_LOCK=file``), every folder a run writes into is claimed, and whatever
is in the claim file's place is named.
"""

from __future__ import annotations

import errno
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
from bad_input_helpers import GOOD, fill, pattern, snapshot
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_eagle.commands.cli import main
from lightning_eagle.commands.strict_yaml import MAX_ALIAS_NODES, ConfigFileError, read_config_file, strict_load
from lightning_eagle.configs import packaged_configs
from lightning_eagle.training import run_folder
from lightning_eagle.training.export_callback import ExportDraftCallback
from lightning_eagle.training.run_folder import (
    CLAIM_NAME,
    LOCK_MODE_ENV,
    LOCK_NAME,
    ROOT,
    FolderInUseError,
    FolderLock,
    FolderLockError,
    RunClaim,
    RunFolderGuard,
)

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
_LAUGHS = "a: &a [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True)
)

# ---- configs ---------------------------------------------------------------------------------------------------------
CONFIGS = {
    "syntax": "trainer:\n  max_steps: [1\n",
    "tag": "trainer: !!python/object/apply:os.system ['true']\n",
    "dup_section": "trainer:\n  max_steps: 1\ndata:\n  batch_size: 2\ntrainer:\n  max_epochs: 1\n",
    "dup_lr": "model:\n  optimization:\n    lr: 1.0e-3\n    warmup_ratio: 0\n    lr: 5.0e-2\n",
    "dup_in_list": "trainer:\n  callbacks:\n    - class_path: a.B\n      init_args: {x: 1, x: 2}\n",
    "bomb": _LAUGHS,
    "recursive": "model: &m\n  loop: *m\n",
    "empty": "",
    "comments": "# nothing but a comment\n\n",
    "list": "- trainer\n- model\n",
    "two_documents": "trainer: {}\n---\nmodel: {}\n",
    "sub_dup": "lr: 1.0e-3\nlr: 2.0e-3\n",
}

FIT = ["fit", "--config", "$quickstart", "--trainer.max_steps", "1", "--trainer.default_root_dir", "$root"]

CONFIG_CASES = [
    pytest.param([*FIT, "--config", "$syntax"], ["error: $syntax:3:1: invalid YAML: did not find expected ',' or ']' "
                                                 "(while parsing a flow sequence at line 2)\n"], id="syntax-error"),
    pytest.param(["fit", "--config", "$tag"],
                 ["error: $tag:1:10: unknown YAML tag '!!python/object/apply:os.system': a run config holds plain "
                  "values"], id="unknown-tag"),
    pytest.param([*FIT, "--config", "$dup_section"],
                 ["error: $dup_section:5: duplicate key 'trainer' (trainer; first at line 1): YAML would keep only "
                  "the last one, silently; write the key once\n"], id="duplicate-section"),
    pytest.param([*FIT, "--config", "$dup_lr"],
                 ["error: $dup_lr:5: duplicate key 'lr' (model.optimization.lr; first at line 3)"], id="duplicate-lr"),
    pytest.param(["fit", "--config=$dup_in_list"],
                 ["error: $dup_in_list:4: duplicate key 'x' (trainer.callbacks[0].init_args.x; first at line 4)"],
                 id="duplicate-in-a-list"),
    pytest.param([*FIT, "--config", "$bomb"],
                 ["error: $bomb: its YAML aliases (*name) would add ", f"values, more than {MAX_ALIAS_NODES} (an "
                  "alias bomb?): refused before expanding them"], id="alias-bomb"),
    pytest.param([*FIT, "--config", "$recursive"],
                 ["error: $recursive:1: an alias refers to the anchored value that contains it (model.loop)"],
                 id="recursive-alias"),
    pytest.param(["fit", "--config", "$empty"],
                 ["error: $empty: the config file is empty (expected a mapping of sections: trainer:, model:, data:)"],
                 id="empty-file"),
    pytest.param(["fit", "--config", "$comments"], ["error: $comments: the config file is empty"], id="only-comments"),
    pytest.param(["fit", "--config", "$list"],
                 ["error: $list: expected a mapping of sections (trainer:, model:, data:), got list"],
                 id="not-a-mapping"),
    pytest.param(["fit", "--config", "$two_documents"],
                 ["error: $two_documents:2:1: a second YAML document (after ---): a run config is one mapping"],
                 id="two-documents"),
    # a sub-config file read by jsonargparse itself goes through the same loader
    pytest.param([*FIT, "--model.optimization", "$sub_dup"],
                 ["error: Parser key \"model.optimization\"", "sub_dup.yaml:2: duplicate key 'lr' (lr; first at "
                  "line 1)"], id="sub-config-duplicate"),
    # the commands that read a run config through the same CLI
    pytest.param(["data-report", "--config", "$dup_lr"], ["error: $dup_lr:5: duplicate key 'lr'"],
                 id="data-report-duplicate"),
    pytest.param(["dump", "--config", "$bomb", "--out", "$root/features"], ["error: $bomb: its YAML aliases"],
                 id="dump-alias-bomb"),
    pytest.param(["memory-plan", "--config", "$empty"], ["error: --config: $empty: the config file is empty"],
                 id="memory-plan-empty"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "fragments"), CONFIG_CASES)
def test_a_config_file_is_read_strictly(tmp_path, monkeypatch, capsys, argv, fragments):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    paths = {name: inputs / f"{name}.yaml" for name in CONFIGS}
    for name, text in CONFIGS.items():
        paths[name].write_text(text)
    paths |= {"quickstart": QUICKSTART, "root": tmp_path / "run"}
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        main(fill(argv, **paths))
    assert time.monotonic() - started < 60  # an alias bomb is refused, not expanded
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1, err
    assert re.search(pattern(fill(fragments, **paths)), err), err
    assert exit_info.value.code == 2, err
    assert snapshot(tmp_path) == before  # nothing written: no run folder, no claim, no logs


def test_every_packaged_config_is_strict_yaml():
    for name, path in packaged_configs().items():
        assert isinstance(read_config_file(path), dict), name


def test_merge_keys_and_jsonargparse_value_rules_are_kept():
    loaded = strict_load(
        "base: &b {lr: 1.0e-3, warmup_ratio: 0.1}\nopt:\n  <<: *b\n  lr: 2.0e-3\nday: 2020-01-01\n", "x"
    )
    assert loaded["opt"] == {"lr": 2.0e-3, "warmup_ratio": 0.1}  # the key written next to the merge overrides it
    assert loaded["day"] == "2020-01-01"  # jsonargparse's resolvers: no timestamps
    with pytest.raises(ConfigFileError, match=r"^x:2: duplicate key 'a' \(m\.a; first at line 2\)"):
        strict_load("m:\n  {a: 1, a: 2}\n", "x")


# ---- the run claim ---------------------------------------------------------------------------------------------------
def _no_flock(code: int):
    def flock(fd, operation):
        raise OSError(code, "simulated")

    return flock


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_file_system_without_flock_is_refused_by_name(tmp_path, monkeypatch, code):
    monkeypatch.setattr(run_folder.fcntl, "flock", _no_flock(code))
    name = errno.errorcode[code]
    with pytest.raises(FolderLockError) as info:
        FolderLock(tmp_path / "run").acquire()
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'run'}: its file system does not support flock ({name}: "), message
    assert f"set {LOCK_MODE_ENV}=file to claim it with an exclusive lock file ({CLAIM_NAME}" in message, message


def test_the_lock_file_fallback_claims_refuses_a_live_holder_and_takes_over_a_dead_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(run_folder.fcntl, "flock", _no_flock(errno.ENOLCK))
    monkeypatch.setenv(LOCK_MODE_ENV, "file")
    root = tmp_path / "run"
    first = RunClaim({ROOT: root})
    first.acquire()
    claim = root / CLAIM_NAME
    assert json.loads(claim.read_text())["pid"] > 0
    with pytest.raises(FolderInUseError, match=re.escape(f"{root} is in use by a live run (pid ")):
        RunClaim({ROOT: root}).acquire()
    first.release()
    assert not claim.exists()  # released: the claim file is gone
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = {"pid": dead.pid, "host": run_folder.socket.gethostname(), "since": time.time(), "folders": [str(root)]}
    claim.write_text(json.dumps(record))
    taken = RunClaim({ROOT: root})
    taken.acquire()  # its process is gone on this host: taken over
    taken.release()
    claim.write_text(json.dumps({**record, "host": "another-host"}))
    with pytest.raises(FolderInUseError, match=re.escape(f"if that run is gone, remove {claim}")):
        RunClaim({ROOT: root}).acquire()
    monkeypatch.setenv(LOCK_MODE_ENV, "fcntl")
    with pytest.raises(FolderLockError, match=f"{LOCK_MODE_ENV}='fcntl': expected one of flock, file"):
        RunClaim({ROOT: root}).acquire()


def test_a_fit_on_a_file_system_without_flock_is_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_folder.fcntl, "flock", _no_flock(errno.ENOLCK))
    rows = tmp_path / "rows.jsonl"
    rows.write_text((json.dumps(GOOD) + "\n") * 8)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(QUICKSTART), "--trainer.default_root_dir", str(tmp_path / "run"),
              "--data.train_files", str(rows), "--data.use_cache", "false"])  # fmt: skip
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" not in err, err
    assert f"error: {tmp_path / 'run'}: its file system does not support flock (ENOLCK: " in err, err


CKPT = "the checkpoint folder (ModelCheckpoint.dirpath)"
EXPORT = "the export folder (ExportDraftCallback.out_dir)"


@pytest.mark.parametrize(
    ("first", "second", "busy"),
    [
        pytest.param({ROOT: "a", CKPT: "shared"}, {ROOT: "b", CKPT: "shared"}, "shared", id="same-checkpoint-folder"),
        pytest.param({ROOT: "a", CKPT: "a/checkpoints"}, {ROOT: "b", CKPT: "a/checkpoints"}, "a/checkpoints",
                     id="checkpoints-under-the-other-runs-root"),
        pytest.param({ROOT: "a", CKPT: "shared"}, {ROOT: "shared"}, "shared", id="root-is-the-other-runs-checkpoints"),
        pytest.param({ROOT: "b", CKPT: "a"}, {ROOT: "c", CKPT: "a/x"}, None, id="inside-another-runs-outside-folder"),
        pytest.param({ROOT: "a", EXPORT: "out/draft"}, {ROOT: "b", EXPORT: "out/draft"}, "out/draft",
                     id="same-export-folder"),
        pytest.param({ROOT: "a", EXPORT: "a/draft"}, {ROOT: "b", EXPORT: "a/draft"}, "a/draft",
                     id="export-into-the-other-runs-default"),
        pytest.param({ROOT: "a", EXPORT: "out/one"}, {ROOT: "b", EXPORT: "out/two"}, None, id="sibling-exports"),
        pytest.param({ROOT: "a"}, {ROOT: "a/sub"}, None, id="a-root-inside-another-root"),
    ],
)  # fmt: skip
def test_every_output_folder_is_claimed(tmp_path, first, second, busy):
    def claim(folders):
        return RunClaim({what: tmp_path / folder for what, folder in folders.items()})

    held = claim(first)
    held.acquire()
    try:
        if busy is None:
            other = claim(second)
            other.acquire()
            other.release()
        else:
            with pytest.raises(FolderInUseError, match=re.escape(f"{tmp_path / busy} is in use by a live run (pid ")):
                claim(second).acquire()
        assert not (tmp_path / "out" / "draft").exists() and not (tmp_path / "a" / "checkpoints").exists()
    finally:
        held.release()
    again = claim(second)
    again.acquire()  # the first run ended: free
    again.release()


@pytest.mark.parametrize("shared", ["checkpoint", "export"])
def test_the_guard_claims_the_checkpoint_and_export_folders_of_a_fit(tmp_path, shared):
    def guard_of(root, ckpt, export):
        callbacks = [ModelCheckpoint(dirpath=ckpt), ExportDraftCallback(out_dir=str(export))]
        trainer = pl.Trainer(default_root_dir=root, callbacks=callbacks, logger=False, enable_progress_bar=False)
        guard = RunFolderGuard()
        guard.setup(trainer, None, "fit")
        return guard

    first = guard_of(tmp_path / "one", tmp_path / "ckpt", tmp_path / "exports" / "draft")
    busy, what = (tmp_path / "ckpt", CKPT) if shared == "checkpoint" else (tmp_path / "exports" / "draft", EXPORT)
    second = {"checkpoint": (tmp_path / "ckpt", tmp_path / "two" / "draft"), "export": (None, busy)}[shared]
    try:
        with pytest.raises(FolderInUseError) as info:
            guard_of(tmp_path / "two", *second)
        assert str(info.value).startswith(f"{busy} is in use by a live run (pid "), info.value
        assert str(info.value).endswith(f"wait for it to end or choose another folder for {what}"), info.value
    finally:
        first.teardown(None, None, "fit")
    assert not (tmp_path / "exports" / "draft").exists()  # the export replaces its whole folder: claimed beside it
    assert (tmp_path / "exports" / f"{LOCK_NAME}.draft").is_file()
    guard_of(tmp_path / "two", *second).teardown(None, None, "fit")


@pytest.mark.parametrize("what", ["dangling-symlink", "folder"])
def test_what_is_in_the_claim_files_place_is_named(tmp_path, what):
    root = tmp_path / "run"
    root.mkdir()
    lock = root / LOCK_NAME
    if what == "folder":
        lock.mkdir()
        expected = f"the run's claim file {lock} is a folder: remove it"
    else:
        lock.symlink_to(tmp_path / "gone")
        expected = f"the run's claim file {lock} is a symbolic link (to {tmp_path / 'gone'}, which does not exist)"
    with pytest.raises(FolderLockError, match=re.escape(expected)):
        RunClaim({ROOT: root}).acquire()
    assert not (tmp_path / "gone").exists()
