"""Continual training (``model.draft.init_from``), both families: a run starts its draft from an export or a training
checkpoint of an earlier draft (weights only: fresh optimizer, schedule and step), against another target checkpoint
of the same shape; its checkpoints record where it started; a start of another family, architecture, taps or
vocabulary is refused by name."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from eagle_helpers import data_kwargs, grouped_settings, trainer_kwargs
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file, save_file

from lightning_eagle import Eagle3Module
from lightning_eagle import checkpoint_keys as keys
from lightning_eagle.data import ChatDataModule
from lightning_eagle.draft.family import draft_family_of
from lightning_eagle.k3.loader import QUICKSTART_TARGET
from lightning_eagle.run_settings import TargetSettings
from lightning_eagle.training.dspark_module import DSparkModule
from lightning_eagle.training.dspark_settings import DSparkDraftSettings, DSparkObjectiveSettings

EAGLE_TAPS, DSPARK_TAPS = [1, 3, 5], (1, 3, 4)


def _eagle(init_from=None, taps=EAGLE_TAPS, target="quickstart", **draft):
    groups = grouped_settings({"target": target, "aux_layer_ids": taps, "target_dtype": "float32", "ttt_steps": 2},
                              {"intermediate_size": 64, **draft})  # fmt: skip
    groups["draft"] = dataclasses.replace(groups["draft"], init_from=init_from and str(init_from))
    return Eagle3Module(**groups)


def _dspark(init_from=None, taps=DSPARK_TAPS, target="quickstart", **config):
    return DSparkModule(
        TargetSettings(path=target, aux_layer_ids=taps, dtype="float32"),
        DSparkDraftSettings(preset="k3-tiny", config=config, init_from=init_from and str(init_from), init_seed=7),
        DSparkObjectiveSettings(num_anchors=12),
    )  # fmt: skip


MAKERS = {"eagle3": _eagle, "dspark": _dspark}


def _trained(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.draft.named_parameters() if p.requires_grad}


def _start(family: str, tmp_path: Path) -> tuple[dict[str, torch.Tensor], Path, Path]:
    """An earlier draft (random weights stand for trained ones): its trained tensors, its export folder and a
    training checkpoint of it (as ``fit`` writes them)."""
    module = MAKERS[family]()
    module.configure_model()
    with torch.no_grad():
        for p in module.draft.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.01)  # not the init every run starts from
    export = draft_family_of(module.draft).export(module, tmp_path / f"{family}_export", dtype=torch.float32)
    checkpoint = {"state_dict": {f"draft.{k}": v for k, v in module.draft.state_dict().items()}, "global_step": 40,
                  keys.TARGET_FINGERPRINT: module.target_spec.fingerprint, **module.checkpoint_record()}  # fmt: skip
    torch.save(checkpoint, tmp_path / f"{family}.ckpt")
    return _trained(module), export, tmp_path / f"{family}.ckpt"


@pytest.fixture(scope="module")
def new_target(tmp_path_factory) -> Path:
    """The quickstart target post-trained: the same shape, other weights, another config fingerprint."""
    folder = tmp_path_factory.mktemp("k3_1_tiny")
    config = json.loads((QUICKSTART_TARGET / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": "k3.1-tiny"}, indent=1))
    weights = load_file(str(QUICKSTART_TARGET / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    moved = {k: v + 0.01 * torch.randn(v.shape, generator=g).to(v.dtype) * (v != 0)  # padding stays zero
             for k, v in weights.items() if v.is_floating_point()}  # fmt: skip
    save_file({**weights, **moved}, str(folder / "model.safetensors"))
    return folder


class _AtStart(pl.Callback):
    def on_train_start(self, trainer, module):
        self.weights, self.step = _trained(module), trainer.global_step
        self.optimizer_state = len(trainer.optimizers[0].state)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "kind"), [("eagle3", "export"), ("dspark", "checkpoint")])
def test_a_run_continues_a_draft_onto_a_new_target_and_records_where_it_started(family, kind, tmp_path, new_target):
    trained, export, checkpoint = _start(family, tmp_path)
    start = export if kind == "export" else checkpoint
    module = MAKERS[family](start, target=str(new_target))
    at_start = _AtStart()
    saved = ModelCheckpoint(dirpath=tmp_path / "run", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=1, limit_val_batches=0, callbacks=[at_start, saved]))
    trainer.fit(module, ChatDataModule(**data_kwargs(max_length=96, batch_size=2, draft_vocab_size=None)))
    assert at_start.step == 0 and at_start.optimizer_state == 0  # weights only: a fresh optimizer and schedule
    assert at_start.weights.keys() == trained.keys()
    for name, value in trained.items():
        torch.testing.assert_close(at_start.weights[name], value, rtol=0, atol=0, msg=name)
    record = torch.load(tmp_path / "run" / "step=1.ckpt", map_location="cpu", weights_only=False)
    origin = record[keys.DRAFT_ORIGIN]
    assert origin["path"] == str(start) and origin["kind"] == kind and origin["family"] == family
    assert record[keys.TARGET_FINGERPRINT] == module.target_spec.fingerprint  # the new target's
    if kind == "checkpoint":
        assert origin["step"] == 40 and origin["target_fingerprint"] != module.target_spec.fingerprint


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("eagle3", {"taps": [1, 2, 5]}, "the start's taps differ from this run's (aux_layer_ids: start [1, 3, 5], "
                                        "this run [1, 2, 5])"),
        ("eagle3", {"intermediate_size": 96}, "the start's architecture differs from this run's (intermediate_size: "
                                              "start 64, this run 96)"),
        ("dspark", {"taps": (1, 2, 4)}, "the start's taps differ from this run's (aux_layer_ids: start [1, 3, 4], "
                                        "this run [1, 2, 4])"),
        ("dspark", {"markov_rank": 16}, "the start's architecture differs from this run's (markov_rank: start 32, "
                                        "this run 16)"),
    ],
)  # fmt: skip
def test_a_start_of_another_architecture_or_taps_is_refused_by_name(family, change, message, tmp_path):
    _, export, checkpoint = _start(family, tmp_path)
    for start in (export, checkpoint):
        module = MAKERS[family](start, **change)
        with pytest.raises(ValueError, match="model.draft.init_from=") as err:
            module.configure_model()
        assert message in str(err.value), str(err.value)


def test_a_start_of_another_vocabulary_or_family_is_refused_by_name(tmp_path):
    _, export, checkpoint = _start("eagle3", tmp_path)
    module = _eagle(checkpoint)
    mapping = type("Map", (), {"selected": torch.arange(320)})()  # a 320-token draft vocabulary, the start's has 512
    refused = r"the start's vocabulary differs from this run's \(draft_vocab_size: start 512, this run 320\)"
    with pytest.raises(ValueError, match=refused):
        module.configure_model(vocab_mapping=mapping)
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    saved["state_dict"]["draft.d2t"][:10] += 3  # the same size, other tokens
    torch.save(saved, tmp_path / "other_map.ckpt")
    with pytest.raises(ValueError, match=r"the start's d2t \(its vocabulary map\) differs from this run's"):
        _eagle(tmp_path / "other_map.ckpt").configure_model()
    _, dspark_export, _ = _start("dspark", tmp_path)
    module = _eagle(dspark_export)
    with pytest.raises(ValueError, match="holds a dspark draft and this run trains a eagle3 draft"):
        module.configure_model()
    with pytest.raises(ValueError, match="no such export folder or checkpoint file"):
        _eagle(tmp_path / "missing").configure_model()
    shutil.copy(tmp_path / "eagle3.ckpt", tmp_path / "cut.ckpt")
    (tmp_path / "cut.ckpt").write_bytes((tmp_path / "cut.ckpt").read_bytes()[:1000])
    with pytest.raises(ValueError, match="not a readable training checkpoint"):
        _eagle(tmp_path / "cut.ckpt").configure_model()
