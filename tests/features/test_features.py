"""Offline features: dump once, train without the target — the same step as online, refusals, resumable dumps."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from eagle_helpers import data_kwargs, eagle_module

from lightning_eagle import ChatDataModule, Eagle3Module
from lightning_eagle.data.final_norm import FINAL_NORM_TYPES, select_final_norm_type
from lightning_eagle.features import HiddenStateDataModule, TeacherHead
from lightning_eagle.features import format as fmt
from lightning_eagle.features.dump import dump_features
from lightning_eagle.k3.loader import QUICKSTART_TARGET, CheckpointError

MODULE = {"target": "quickstart", "aux_layer_ids": [1, 3, 5], "target_dtype": "float32", "ttt_steps": 3,
          "draft": {"intermediate_size": 64}}  # fmt: skip
DATA = data_kwargs(batch_size=4, max_length=128)


def _trainer(root: Path, **kw) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(root), **kw)  # fmt: skip


def _dump(out: Path, **kw) -> Path:
    return dump_features(eagle_module(**MODULE).target_spec, ChatDataModule(**DATA), out, _trainer(out.parent), **kw)


@pytest.fixture(scope="module")
def fp32_dump(tmp_path_factory) -> Path:
    return _dump(tmp_path_factory.mktemp("dump") / "features", dtype="float32", shard_rows=64)


def _step(module: Eagle3Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    module.draft.zero_grad(set_to_none=True)
    out = module.shared_step(batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in module.draft.named_parameters() if p.grad is not None}


def _first_batch(data) -> dict:
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def _online_and_offline(features: Path, **offline_module):
    chats = ChatDataModule(**DATA)
    online = eagle_module(**MODULE)
    online_batch = _first_batch(chats)
    online.configure_model(vocab_mapping=chats.vocab_mapping)
    offline_data = HiddenStateDataModule(str(features), batch_size=DATA["batch_size"])
    offline = eagle_module(**MODULE, target_source="features", **offline_module)
    offline_batch = _first_batch(offline_data)
    trainer = _trainer(features.parent)  # the module reads the manifest through trainer.datamodule
    trainer.datamodule = offline_data
    offline._trainer = trainer
    offline.configure_model(vocab_mapping=offline_data.vocab_mapping)
    return (online, online_batch), (offline, offline_batch), offline_data


def test_dump_writes_manifest_shards_and_the_vocab_map(fp32_dump):
    manifest = json.loads((fp32_dump / fmt.MANIFEST_NAME).read_text())
    assert manifest["hidden_states"] == "prenorm" and manifest["dtype"] == "float32"
    assert manifest["aux_layer_ids"] == [1, 3, 5] and manifest["aux_stream"] == "prefix"
    assert manifest["target"]["config_sha256"] == eagle_module(**MODULE).target_spec.fingerprint
    chats = ChatDataModule(**DATA)
    chats.setup("fit")
    assert manifest["rows"] == {"train": len(chats.train_dataset), "val": len(chats.val_dataset)}
    assert manifest["num_shards"] == -(-(len(chats.train_dataset) + len(chats.val_dataset)) // 64)
    assert sum(s["tokens"] for s in manifest["shards"]) == manifest["tokens"]
    assert manifest["bytes_per_token"] == 4 * 128 * 4 + 5  # (3 taps + final hidden) × H × fp32 + id + mask
    for shard in manifest["shards"]:
        assert fmt.sha256_file(fp32_dump / shard["shard"]) == shard["sha256"]
    assert not [p for p in fp32_dump.iterdir() if p.name.endswith(".partial")]


def test_one_offline_step_equals_the_online_step(fp32_dump):
    (online, online_batch), (offline, offline_batch), data = _online_and_offline(fp32_dump)
    for key in ("input_ids", "attention_mask", "loss_mask"):  # same rows, same order, same padding
        assert torch.equal(online_batch[key], offline_batch[key]), key
    assert torch.equal(offline.draft.selected_token_ids, online.draft.selected_token_ids)
    loss_on, grads_on = _step(online, online_batch)
    loss_off, grads_off = _step(offline, offline_batch)
    torch.testing.assert_close(loss_off, loss_on, rtol=1e-5, atol=1e-6)
    assert grads_on.keys() == grads_off.keys() and grads_on
    for name, grad in grads_on.items():
        torch.testing.assert_close(grads_off[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_bf16_and_postnorm_dumps(tmp_path, fp32_dump, capsys):
    _, (ref, ref_batch), _ = _online_and_offline(fp32_dump)
    ref_loss, _ = _step(ref, ref_batch)
    post = _dump(tmp_path / "post", dtype="float32", hidden_states="postnorm", shard_rows=400)
    _, (offline, batch), _ = _online_and_offline(post)
    assert offline.source.head.norm is None  # post-norm features: no norm applied twice
    torch.testing.assert_close(_step(offline, batch)[0], ref_loss, rtol=1e-5, atol=1e-6)
    bf16 = _dump(tmp_path / "bf16", shard_rows=400)
    _, (offline, batch), _ = _online_and_offline(bf16)
    loss = _step(offline, batch)[0]
    relative = float((loss - ref_loss).abs() / ref_loss)
    with capsys.disabled():
        print(f"\nbf16 dump: step loss {float(loss):.6f} vs fp32 {float(ref_loss):.6f} (relative {relative:.2e})")
    assert relative < 1e-2


def test_teacher_head_norm_is_keyed_on_the_text_config():
    config = json.loads((QUICKSTART_TARGET / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and config["text_config"]["model_type"] == "kimi_linear"
    assert select_final_norm_type(config) == "rmsnorm"
    # A lookup keyed on the outer model_type finds nothing: that would be an un-normed teacher.
    assert "kimi_k3" not in FINAL_NORM_TYPES and select_final_norm_type({"model_type": "kimi_k3"}) is None
    head = TeacherHead.from_checkpoint("quickstart", prenorm=True)
    from lightning_eagle.k3.model import KimiK3ForCausalLM

    target = KimiK3ForCausalLM.from_pretrained("quickstart", dtype=torch.float32)
    assert torch.equal(head.norm.weight, target.model.norm.weight)  # exact: copied from the same checkpoint tensor
    h = torch.randn(2, 5, 128)
    torch.testing.assert_close(head.final_hidden(h, stored_prenorm=True), target.model.norm(h))


def _target_copy(tmp_path: Path, edit_config=None, drop_key: str | None = None) -> Path:
    folder = tmp_path / "target"
    shutil.copytree(QUICKSTART_TARGET, folder)
    config = json.loads((folder / "config.json").read_text())
    if edit_config:
        edit_config(config)
        (folder / "config.json").write_text(json.dumps(config))
    if drop_key:
        from safetensors.torch import load_file, save_file

        state = load_file(str(folder / "model.safetensors"))
        del state[drop_key]
        save_file(state, str(folder / "model.safetensors"))
    return folder


def test_teacher_head_refuses_an_unknown_norm_type_and_a_missing_norm(tmp_path):
    unknown = _target_copy(tmp_path / "a", lambda c: c["text_config"].update(model_type="mystery"))
    with pytest.raises(ValueError, match="text model_type 'mystery' has no entry in the final-norm table"):
        TeacherHead.from_checkpoint(unknown, prenorm=True)
    assert TeacherHead.from_checkpoint(unknown, prenorm=False).norm is None  # post-norm features need none
    no_norm = _target_copy(tmp_path / "b", drop_key="language_model.model.norm.weight")
    with pytest.raises(CheckpointError, match="no norm weight .language_model.model.norm.weight"):
        TeacherHead.from_checkpoint(no_norm, prenorm=True)


def test_killed_dump_resumes_rewriting_only_missing_or_corrupt_shards(tmp_path, fp32_dump):
    out = tmp_path / "features"
    shutil.copytree(fp32_dump, out)
    (out / fmt.MANIFEST_NAME).unlink()  # killed before the end
    (out / fmt.shard_name(2)).unlink()
    (out / fmt.shard_name(2).replace(".safetensors", ".json")).unlink()
    corrupt = out / fmt.shard_name(4)
    corrupt.write_bytes(corrupt.read_bytes()[:-10] + b"0123456789")  # checksum no longer matches
    (out / ".shard-00005.safetensors.123-deadbeef.partial").write_bytes(b"half")  # a killed writer's leftover
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.safetensors")}
    _dump(out, dtype="float32", shard_rows=64)
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.safetensors")}
    rewritten = sorted(n for n in after if before.get(n) != after[n])
    assert rewritten == [fmt.shard_name(2), fmt.shard_name(4)]
    assert (
        json.loads((out / fmt.MANIFEST_NAME).read_text())["shards"]
        == json.loads((fp32_dump / fmt.MANIFEST_NAME).read_text())["shards"]
    )
    assert not [p for p in out.iterdir() if p.name.endswith(".partial")]


def test_dump_refuses_a_folder_of_other_features_and_a_full_disk(tmp_path, fp32_dump, monkeypatch):
    out = tmp_path / "features"
    shutil.copytree(fp32_dump, out)
    with pytest.raises(ValueError, match="holds a dump of other features .dtype: 'float32' there, 'bfloat16' now"):
        _dump(out, shard_rows=64)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**6, 10**6 - 1000, 1000))
    manifest = json.loads((fp32_dump / fmt.MANIFEST_NAME).read_text())
    need = f"{manifest['tokens'] * manifest['bytes_per_token'] / 1e9:.3f} GB needed"
    with pytest.raises(OSError, match=rf"not enough disk space for the dump in .*small: {need}, 0.000 GB free"):
        _dump(tmp_path / "small", dtype="float32", shard_rows=64)
    assert not list((tmp_path / "small").glob("shard-*"))


def test_offline_run_refuses_other_features(tmp_path, fp32_dump):
    data = HiddenStateDataModule(str(fp32_dump))
    module = eagle_module(**{**MODULE, "aux_layer_ids": [1, 2, 5]}, target_source="features")
    trainer = _trainer(tmp_path)
    trainer.datamodule, module._trainer = data, trainer
    with pytest.raises(
        ValueError, match=r"tap layers \[1, 3, 5\] \(prefix stream\), this module trains on \[1, 2, 5\]"
    ):
        module.setup("fit")
    online = eagle_module(**MODULE)
    online._trainer = trainer
    with pytest.raises(ValueError, match="the data module holds dumped features: set model.target.source='features'"):
        online.setup("fit")
    with pytest.raises(ValueError, match="the checkpoint was trained on other features"):
        data.load_state_dict({**data.state_dict(), "features": "0123456789abcdef"})
    with pytest.raises(FileNotFoundError, match="has no manifest.json .an unfinished dump"):
        os.makedirs(tmp_path / "empty")
        HiddenStateDataModule(str(tmp_path / "empty"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_expert_parallel_dump_equals_the_single_process_dump(tmp_path, fp32_dump):
    from safetensors.torch import load_file

    from lightning_eagle.parallel.strategy import ExpertParallelStrategy

    strategy = ExpertParallelStrategy(expert_parallel_size=2, start_method="fork")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))  # fmt: skip
    out = dump_features(eagle_module(**MODULE).target_spec, ChatDataModule(**DATA), tmp_path / "ep", trainer,
                        dtype="float32", shard_rows=64)  # fmt: skip
    ep, single = (json.loads((d / fmt.MANIFEST_NAME).read_text()) for d in (out, fp32_dump))
    assert [s["rows"] for s in ep["shards"]] == [s["rows"] for s in single["shards"]]
    for shard in single["shards"]:  # rank r wrote shards r, r+2, …; the experts were split over the two ranks
        a, b = load_file(str(out / shard["shard"])), load_file(str(fp32_dump / shard["shard"]))
        for key in ("input_ids", "loss_mask", "offsets", "row_ids"):
            assert torch.equal(a[key], b[key]), key
        for key in ("aux_hidden_states", "hidden_states"):
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)


def test_held_out_prompts_are_the_online_runs(fp32_dump):
    from lightning_eagle.data.prompts import prompts_from_datamodule

    chats = ChatDataModule(**DATA)
    chats.setup("fit")
    online = prompts_from_datamodule(chats, 5)
    assert online and HiddenStateDataModule(str(fp32_dump)).held_out_prompts(5) == online


@pytest.mark.parametrize(
    "damage, verify, fragment",
    [
        ("flip", "checksum", "sha256 differs from the manifest's"),  # bytes damaged in place: trained NaN, exit 0
        ("truncate", "size", "truncated"),  # a cut copy: crashed inside safetensors without naming the shard
        ("truncate", "checksum", "truncated"),
    ],
)
def test_a_damaged_shard_is_refused_by_name_before_training(tmp_path, fp32_dump, damage, verify, fragment):
    dump = Path(shutil.copytree(fp32_dump, tmp_path / "dump"))
    shard = sorted(dump.glob("shard-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[-100:-96] = b"\xff\xff\xff\x7f"  # a NaN-ish float in the last tensor's bytes
    else:
        data = data[: len(data) - 1000]
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{re.escape(str(shard))}: .*{fragment}.*re-run the dump"):
        HiddenStateDataModule(str(dump), verify=verify)
    if damage == "flip":
        HiddenStateDataModule(str(dump), verify="size")  # the cheap check cannot see a flipped byte: documented
