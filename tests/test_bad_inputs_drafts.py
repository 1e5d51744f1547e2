"""Damaged drafts never reach serving (issue 39, part 2), both families: NaN / inf weights, a float tensor stored in
another dtype, a DSpark export with a field missing or a cut file, a checkpoint of the other family, and an export
read while a fit replaces it.

Each case asserts one clear error naming the file / checkpoint and the tensor or field (expected vs got), raised by
this library, and nothing written; on the command line one ``error:`` line, no traceback, exit status 1.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import lightning
import pytest
import torch
from bad_input_helpers import assert_raised_by_library, expect, fill, pattern, snapshot
from draft_helpers import tiny_draft
from eagle_helpers import grouped_settings
from safetensors.torch import load_file, save_file

from lightning_eagle import Eagle3Module
from lightning_eagle import checkpoint_keys as keys
from lightning_eagle.commands.cli import main
from lightning_eagle.draft import dspark_export
from lightning_eagle.draft import serving_format as fmt
from lightning_eagle.draft.dspark import DSparkDrafter
from lightning_eagle.draft.dspark_config import dspark_config_from_preset
from lightning_eagle.draft.dspark_export import export_dspark_draft, load_dspark_export
from lightning_eagle.draft.export import export_draft
from lightning_eagle.inference.draft_families import load_draft
from lightning_eagle.run_settings import TargetSettings
from lightning_eagle.training.dspark_module import DSparkModule
from lightning_eagle.training.dspark_settings import DSparkDraftSettings, DSparkObjectiveSettings

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
NAN_TENSOR = {"eagle3": "fc.weight", "dspark": "context_proj.weight"}


def tiny_dspark(seed: int = 0, **overrides) -> DSparkDrafter:
    torch.manual_seed(seed)
    return DSparkDrafter(dspark_config_from_preset("k3-tiny", **overrides))


def _export(family: str, folder: Path, seed: int = 0, overwrite: bool = False, **overrides) -> Path:
    if family == "eagle3":
        return export_draft(tiny_draft(seed=seed, **overrides), folder, overwrite=overwrite)
    return export_dspark_draft(tiny_dspark(seed, **overrides), folder, dtype=torch.float32, overwrite=overwrite)


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    return {family: _export(family, root / family) for family in ("eagle3", "dspark")}


def _module(family: str):
    if family == "eagle3":
        flat = {"target": "quickstart", "aux_layer_ids": [1, 3, 5], "target_dtype": "float32", "ttt_steps": 2}
        return Eagle3Module(**grouped_settings(flat, {"intermediate_size": 64}))
    target = TargetSettings(path="quickstart", aux_layer_ids=(1, 3, 4), dtype="float32")
    return DSparkModule(
        target, DSparkDraftSettings(preset="k3-tiny", init_seed=7), DSparkObjectiveSettings(num_anchors=12)
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A training checkpoint of each family against the bundled quickstart target (random weights stand for trained
    ones), as ``fit`` writes its keys."""
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for family in ("eagle3", "dspark"):
        module = _module(family)
        module.configure_model()
        checkpoint = {"state_dict": {f"draft.{k}": v for k, v in module.draft.state_dict().items()},
                      "global_step": 1, "epoch": 0, "pytorch-lightning_version": lightning.__version__,
                      keys.TARGET_FINGERPRINT: module.target_spec.fingerprint,
                      **module.checkpoint_record()}  # fmt: skip
        torch.save(checkpoint, root / f"{family}.ckpt")
        out[family] = root / f"{family}.ckpt"
    return out


def _edit_weights(edit):
    def apply(folder: Path) -> None:
        state = load_file(str(folder / "model.safetensors"))
        edit(state)
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})

    return apply


def _poison(value: float, name: str):
    def edit(state):
        state[name] = state[name].clone()
        state[name].view(-1)[3] = value

    return _edit_weights(edit)


def _retype(name: str, dtype: torch.dtype):
    return _edit_weights(lambda state: state.__setitem__(name, state[name].to(dtype)))


def _config(edit):
    def apply(folder: Path) -> None:
        data = json.loads((folder / "config.json").read_text())
        edit(data)
        (folder / "config.json").write_text(json.dumps(data))

    return apply


def _truncate(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


# ---- loaders: inference.draft_families.load_draft (acceptance, the callback) over both families' loaders ------------
LOAD_CASES = [
    pytest.param("eagle3", _poison(float("nan"), "fc.weight"),
                 ["$dir/model.safetensors: tensor 'fc.weight' holds 1 non-finite value(s) (NaN/inf) of 49152"],
                 id="eagle3-nan"),
    pytest.param("eagle3", _poison(float("-inf"), "midlayer.mlp.down_proj.weight"),
                 ["$dir/model.safetensors: tensor 'midlayer.mlp.down_proj.weight' holds 1 non-finite value(s)"],
                 id="eagle3-inf"),
    pytest.param("eagle3", _retype("fc.weight", torch.int32),
                 ["$dir/model.safetensors does not match $dir/config.json: export key fc.weight: dtype torch.int32, "
                  "expected torch.float32 (config.json torch_dtype)"], id="eagle3-int32-tensor"),
    pytest.param("eagle3", _retype("norm.weight", torch.float16),
                 ["export key norm.weight: dtype torch.float16, expected torch.float32 (config.json torch_dtype)"],
                 id="eagle3-other-float-dtype"),
    pytest.param("dspark", _poison(float("nan"), "context_proj.weight"),
                 ["$dir/model.safetensors: tensor 'context_proj.weight' holds 1 non-finite value(s) (NaN/inf)"],
                 id="dspark-nan"),
    pytest.param("dspark", _poison(float("inf"), "confidence_head.proj.weight"),
                 ["$dir/model.safetensors: tensor 'confidence_head.proj.weight' holds 1 non-finite value(s)"],
                 id="dspark-inf"),
    pytest.param("dspark", _retype("context_proj.weight", torch.int32),
                 ["$dir/model.safetensors: tensor 'context_proj.weight' is stored as torch.int32, expected "
                  "torch.float32 (config.json torch_dtype 'float32')"], id="dspark-int32-tensor"),
    pytest.param("dspark", _retype("context_norm.weight", torch.bfloat16),
                 ["tensor 'context_norm.weight' is stored as torch.bfloat16, expected torch.float32"],
                 id="dspark-other-float-dtype"),
    pytest.param("dspark", _config(lambda d: d.pop("hidden_size")),
                 ["$dir/config.json: lacks the field(s) ['hidden_size'] of a DSpark export"],
                 id="dspark-config-lacks-a-field"),
    pytest.param("dspark", _config(lambda d: d.pop("target_layer_ids")),
                 ["$dir/config.json: lacks the field(s) ['target_layer_ids']"],
                 id="dspark-config-lacks-the-taps"),
    pytest.param("dspark", _truncate,
                 ["$dir/model.safetensors: cannot read safetensors file, it is truncated or corrupt"],
                 id="dspark-truncated-weights"),
    pytest.param("dspark", lambda d: (d / "config.json").write_text("{"),
                 ["$dir/config.json: not JSON (Expecting property name"],
                 id="dspark-config-invalid-json"),
    pytest.param("dspark", lambda d: (d / "model.safetensors").unlink(),
                 ["DSpark export '$dir' has no model.safetensors"], id="dspark-missing-weights"),
]  # fmt: skip


@pytest.mark.parametrize(("family", "edit", "fragments"), LOAD_CASES)
def test_a_damaged_export_is_refused_by_its_loader(tmp_path, exports, family, edit, fragments):
    directory = Path(shutil.copytree(exports[family], tmp_path / "draft"))
    edit(directory)
    before = snapshot(tmp_path)
    exc = FileNotFoundError if "has no" in fragments[0] else ValueError
    with expect(exc, fragments, dir=directory) as info:
        load_draft(directory, None)
    assert_raised_by_library(info)
    assert snapshot(tmp_path) == before


# ---- writers: export_draft / export_dspark_draft refuse non-finite weights ------------------------------------------
def _damaged(family: str):
    draft = tiny_draft() if family == "eagle3" else tiny_dspark()
    with torch.no_grad():
        dict(draft.named_parameters())[NAN_TENSOR[family]].view(-1)[0] = float("nan")
    return draft


@pytest.mark.parametrize(
    ("family", "fragments"),
    [
        ("eagle3", ["refusing to export the draft of KimiK3Eagle3Draft: tensor 'fc.weight' holds 1 non-finite value"]),
        ("dspark", ["refusing to export the DSpark draft of DSparkDrafter: tensor 'context_proj.weight' holds 1 "
                    "non-finite value(s) (NaN/inf)"]),
    ],
)  # fmt: skip
def test_an_export_of_non_finite_weights_is_refused(tmp_path, family, fragments):
    with expect(ValueError, fragments) as info:
        if family == "eagle3":
            export_draft(_damaged(family), tmp_path / "out")
        else:
            export_dspark_draft(_damaged(family), tmp_path / "out")
    assert_raised_by_library(info)
    assert list(tmp_path.iterdir()) == []


def test_an_export_of_a_checkpoint_path_names_the_checkpoint(tmp_path, checkpoints):
    saved = torch.load(checkpoints["eagle3"], weights_only=False)
    saved["state_dict"]["draft.fc.weight"][0, 0] = float("inf")
    torch.save(saved, tmp_path / "bad.ckpt")
    with expect(ValueError, [f"refusing to export checkpoint '{tmp_path / 'bad.ckpt'}': tensor 'fc.weight' holds 1 "
                             "non-finite value(s)"]) as info:  # fmt: skip
        export_draft(tmp_path / "bad.ckpt", tmp_path / "out")
    assert_raised_by_library(info)
    assert not (tmp_path / "out").exists()


# ---- command line: export, acceptance, fit / validate --ckpt_path ----------------------------------------------------
def _run_cli(argv: list[str], tmp_path: Path, capsys, monkeypatch, fragments: list[str], **paths) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIGHTNING_EAGLE_DEBUG", raising=False)
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(fill(argv, **paths))
    code, err = exit_info.value.code, capsys.readouterr().err
    if isinstance(code, str):  # SystemExit("error: …") (acceptance): Python prints it on stderr and exits with 1
        code, err = 1, err + code + "\n"
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert re.search(pattern(fill(fragments, **paths)), errors[0]), err
    assert code == 1, err
    after = snapshot(tmp_path)
    assert {k for k in before if after.get(k) != before[k]} == set(), "an input file changed or vanished"
    assert not (tmp_path / "out").exists() and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("family", ["eagle3", "dspark"])
def test_cli_export_refuses_a_checkpoint_with_non_finite_weights(tmp_path, checkpoints, capsys, monkeypatch, family):
    """Before: the NaN draft was written into the serving model.safetensors and the serve line printed."""
    saved = torch.load(checkpoints[family], weights_only=False)
    saved["state_dict"][f"draft.{NAN_TENSOR[family]}"].view(-1)[5] = float("nan")
    torch.save(saved, tmp_path / "nan.ckpt")
    _run_cli(["export", "$ckpt", "$tmp/out"], tmp_path, capsys, monkeypatch,
             ["error: refusing to export checkpoint '$ckpt': tensor 'draft.$name' holds 1 non-finite value(s) "
              "(NaN/inf)", "nothing was written"],
             ckpt=tmp_path / "nan.ckpt", tmp=tmp_path, name=NAN_TENSOR[family])  # fmt: skip
    assert "vllm serve" not in capsys.readouterr().out


@pytest.mark.parametrize("family", ["eagle3", "dspark"])
def test_cli_acceptance_refuses_an_export_with_non_finite_weights(tmp_path, exports, capsys, monkeypatch, family):
    """Before: ``mean acceptance length 1.000`` printed as if measured."""
    directory = Path(shutil.copytree(exports[family], tmp_path / "draft"))
    _poison(float("nan"), NAN_TENSOR[family])(directory)
    _run_cli(["acceptance", "--target", "quickstart", "--draft", "$dir", "--num-prompts", "1", "--max-new-tokens", "2"],
             tmp_path, capsys, monkeypatch,
             ["error: $dir/model.safetensors: tensor '$name' holds 1 non-finite value(s) (NaN/inf)"],
             dir=directory, name=NAN_TENSOR[family])  # fmt: skip
    assert "acceptance length" not in capsys.readouterr().out


FIT = ["--trainer.max_steps", "1", "--trainer.limit_val_batches", "1", "--trainer.default_root_dir", "$tmp/run",
       "--data.train_files", "$rows", "--data.use_cache", "false", "--data.val_fraction", "0"]  # fmt: skip


@pytest.mark.parametrize(
    ("command", "config", "ckpt", "fragments"),
    [
        ("fit", str(QUICKSTART), "dspark", ["error: the checkpoint holds a dspark draft and this run trains a eagle3 "
                                            "draft (Eagle3Module)"]),
        ("validate", str(QUICKSTART), "dspark", ["error: the checkpoint holds a dspark draft and this run trains a "
                                                 "eagle3 draft"]),
        ("fit", "quickstart_dspark", "eagle3", ["error: the checkpoint holds a eagle3 draft and this run trains a "
                                                "dspark draft (DSparkModule)"]),
    ],
)  # fmt: skip
def test_a_checkpoint_of_the_other_family_is_refused_in_one_line(tmp_path, checkpoints, capsys, monkeypatch, command,
                                                                 config, ckpt, fragments):  # fmt: skip
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    good = {"messages": [{"role": "user", "content": "hi, how are you?"}, {"role": "assistant", "content": "fine"}]}
    (inputs / "rows.jsonl").write_text((json.dumps(good) + "\n") * 8)
    shutil.copy(checkpoints[ckpt], inputs / "other.ckpt")
    argv = [command, "--config", config, *FIT, "--ckpt_path", "$ckpt"]
    _run_cli(argv, tmp_path, capsys, monkeypatch, fragments, tmp=tmp_path, rows=inputs / "rows.jsonl",
             ckpt=inputs / "other.ckpt")  # fmt: skip


# ---- an export read while a fit replaces it: one write's config and weights ------------------------------------------
@pytest.mark.parametrize("family", ["eagle3", "dspark"])
def test_a_load_during_a_replacement_reads_one_writes_config_and_weights(tmp_path, monkeypatch, family):
    """The loader reads config.json, then the weights; a writer replacing the folder in between (here: exactly
    then, every time for the first read) made the reader pair write A's config with write B's tensors (18 of 1114
    loads in a tight loop, a shape error or a silently other draft). Both files carry the write's id: the mixed pair
    is noticed and the export read again, whole."""
    folder = _export(family, tmp_path / "draft", seed=0, markov_rank=8) if family == "dspark" else (
        _export(family, tmp_path / "draft", seed=0, intermediate_size=64))  # fmt: skip
    real = fmt.read_safetensors
    calls = []

    writing = []

    def replaced_first(file):
        if writing:  # the writer's own check of what it wrote
            return real(file)
        calls.append(file)
        if len(calls) == 1:  # the writer finishes between this reader's config and weights
            writing.append(True)
            if family == "dspark":
                _export(family, folder, seed=1, overwrite=True, markov_rank=16)
            else:
                _export(family, folder, seed=1, overwrite=True, intermediate_size=96)
            writing.clear()
        return real(file)

    monkeypatch.setattr(fmt, "read_safetensors", replaced_first)
    monkeypatch.setattr(dspark_export, "read_safetensors", replaced_first)
    _, draft = load_draft(folder, None)
    # the mixed pair, then write B whole (EAGLE-3 also reads its training settings from config.json before and after
    # the load: write A's id before, B's after, so it loads once more)
    assert len(calls) == (2 if family == "dspark" else 3)
    if family == "dspark":
        assert draft.config.markov_rank == 16
        expected = load_file(str(folder / "model.safetensors"))
        assert all(torch.equal(draft.state_dict()[k], v.float()) for k, v in expected.items())
    else:
        assert draft.config.intermediate_size == 96


@pytest.mark.parametrize("family", ["eagle3", "dspark"])
def test_files_of_two_writes_are_refused_by_name(tmp_path, family):
    first = _export(family, tmp_path / "a", seed=0)
    second = _export(family, tmp_path / "b", seed=1)
    shutil.copy(second / "model.safetensors", first / "model.safetensors")
    with expect(ValueError, [f"{first}: config.json (write ", ") and its weights (write ", "come from different "
                             f"writes in {fmt.SNAPSHOT_READS} reads"]) as info:  # fmt: skip
        load_draft(first, None)
    assert_raised_by_library(info)


@pytest.mark.parametrize("family", ["eagle3", "dspark"])
def test_an_export_records_one_write_id_in_both_files(tmp_path, family):
    from safetensors import safe_open

    folder = _export(family, tmp_path / "draft")
    recorded = json.loads((folder / "config.json").read_text())[fmt.WRITE_ID_KEY]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert f.metadata()[fmt.WRITE_ID_KEY] == recorded and f.metadata()["format"] == "pt"
    again = _export(family, tmp_path / "draft", overwrite=True)
    assert json.loads((again / "config.json").read_text())[fmt.WRITE_ID_KEY] != recorded
    if family == "dspark":
        assert load_dspark_export(folder).config == tiny_dspark().config


def test_a_load_in_the_moment_of_a_folder_swap_reads_again_and_a_real_refusal_does_not(tmp_path, exports, monkeypatch):
    """Between the two renames of a folder swap the export's name is missing (before: "draft folder … does not
    exist" to a reader of a fit's export); a failure is retried when another folder stood there before and after
    the read, and is final at once when the same folder did (a damaged export is read once)."""
    from lightning_eagle.inference import draft_families

    folder = Path(shutil.copytree(exports["dspark"], tmp_path / "draft"))
    real, calls = draft_families.load_export, []

    def swapped_first(path, *args):
        calls.append(path)
        if len(calls) == 1:  # the swap's first rename happened; the new folder arrives after this read failed
            aside = Path(shutil.move(folder, tmp_path / "old"))
            try:
                return real(path, *args)
            finally:
                shutil.copytree(aside, folder)
        return real(path, *args)

    monkeypatch.setattr(draft_families, "load_export", swapped_first)
    assert load_draft(folder, None)[0] == "dspark" and len(calls) == 2
    calls.clear()
    _poison(float("nan"), NAN_TENSOR["dspark"])(folder)
    monkeypatch.setattr(draft_families, "load_export", lambda path, *args: calls.append(path) or real(path, *args))
    with expect(ValueError, ["tensor 'context_proj.weight' holds 1 non-finite value(s)"]):
        load_draft(folder, None)
    assert len(calls) == 1
