"""``DSparkModule``, the second draft family: its settings (checked once, messages naming the YAML key), its step
(plain and chunked objective agree in value and gradients; the target's embedding and LM head are never trained or
saved), ``model.class_path`` picking the family on the command line, and the quickstart DSpark fit through
``cli.py`` in a subprocess: it trains, validates and exports a drafter our reader loads; ``cli.py export`` writes the
same drafter with the ``vllm serve`` line; ``--ckpt_path last`` continues exactly like the uninterrupted run."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml
from dspark_fit_helpers import cli, dspark_config
from safetensors.torch import load_file

from lightning_eagle.draft.dspark_export import load_dspark_export
from lightning_eagle.run_settings import TargetSettings, refuse_flat_model_keys
from lightning_eagle.training.dspark_anchors import anchor_generator
from lightning_eagle.training.dspark_module import DSparkModule, dspark_run_spec
from lightning_eagle.training.dspark_settings import DSparkDraftSettings, DSparkObjectiveSettings

TINY_TARGET = TargetSettings(path="quickstart", aux_layer_ids=(1, 3, 4), dtype="float32")
TINY_DRAFT = DSparkDraftSettings(preset="k3-tiny")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: DSparkObjectiveSettings(num_anchors=0), "model.objective.num_anchors must be an integer > 0"),
        (lambda: DSparkObjectiveSettings(l1=-0.5), "model.objective.l1 must be >= 0"),
        (lambda: DSparkObjectiveSettings(slot_decay=0.0), "model.objective.slot_decay must be > 0"),
        (lambda: DSparkObjectiveSettings(ce=0.0, l1=0.0), "model.objective: ce and l1 are both 0"),
        (lambda: DSparkObjectiveSettings(loss_backend="fast"), "model.objective.loss_backend: unknown"),
        (lambda: DSparkObjectiveSettings(anchor_seed=-1), "model.objective.anchor_seed must be an integer >= 0"),
        (lambda: DSparkDraftSettings(block_chunk=0), "model.draft.block_chunk must be a positive int"),
        (lambda: DSparkDraftSettings(kv_cache="paged"), "model.draft.kv_cache must be one of 'expanded', 'latent'"),
        (lambda: DSparkDraftSettings(dtype="float8"), "model.draft.dtype must be one of"),
        (lambda: DSparkDraftSettings(shard="yes"), "model.draft.shard must be true or false"),
        (lambda: DSparkDraftSettings(config={"aux_layer_ids": [1]}), "set model.target.aux_layer_ids instead"),
        (lambda: DSparkDraftSettings(config={"vocab_size": 8}), "model.draft.config.vocab_size: set the target's"),
    ],
)
def test_each_dspark_setting_is_checked_where_it_is_made(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_the_run_spec_takes_the_targets_sizes_and_the_run_taps():
    spec, config = dspark_run_spec(TINY_TARGET, TINY_DRAFT)
    assert list(spec.aux_layer_ids) == config.aux_layer_ids == [1, 3, 4]
    assert (config.vocab_size, config.target_hidden_size) == (spec.config.vocab_size, spec.config.hidden_size)
    assert config.target_num_hidden_layers == spec.config.num_hidden_layers
    # five taps (the real K3's count) are fine for the drafter, never for EAGLE-3's three-tap spec
    spec5, config5 = dspark_run_spec(TargetSettings(path="quickstart", aux_layer_ids=(0, 1, 2, 3, 4)), TINY_DRAFT)
    assert config5.num_target_layers == 5 and config5.context_size == 5 * spec5.config.hidden_size


@pytest.mark.parametrize(
    ("target", "draft", "message"),
    [
        (TargetSettings(path="quickstart", aux_layer_ids=(3, 1, 4)), TINY_DRAFT, "ids must be ascending: vLLM sorts"),
        (TargetSettings(path="quickstart", aux_layer_ids=(1, 3, 6)), TINY_DRAFT, r"must be in \[0, 5\]"),
        (TargetSettings(path="quickstart"), DSparkDraftSettings(preset="k3"), "preset 'k3''s"),  # K3 taps, tiny target
        (TINY_TARGET, DSparkDraftSettings(preset="k4"), "model.draft.preset 'k4' is unknown"),
        (TINY_TARGET, DSparkDraftSettings(preset="k3-tiny", config={"widths": 3}), "model.draft.config: .*widths"),
        (TINY_TARGET, DSparkDraftSettings(preset="k3-tiny", config={"mask_token_id": 512}), "mask_token_id"),
    ],
)
def test_the_run_spec_refuses_by_setting(target, draft, message):
    with pytest.raises(ValueError, match=message):
        dspark_run_spec(target, draft)


def test_flat_keys_are_refused_by_the_family_class_path_names(tmp_path):
    from lightning_eagle.commands.cli import refuse_flat_settings

    dspark, settings = "lightning_eagle.training.dspark_module.DSparkModule", DSparkModule.settings_groups["draft"]
    refuse_flat_model_keys({"class_path": dspark, "init_args": {"draft": {"block_chunk": 8, "preset": "k3"}}}, "x",
                           settings)  # fmt: skip
    with pytest.raises(ValueError, match="model.draft.block_size is now model.draft.config.block_size"):
        refuse_flat_model_keys({"class_path": dspark, "init_args": {"draft": {"block_size": 7}}}, "x", settings)
    with pytest.raises(ValueError, match="model.draft.block_chunk is now model.draft.config.block_chunk"):
        refuse_flat_model_keys({"draft": {"block_chunk": 8}}, "x")  # no class path: EAGLE-3's draft settings
    # the command line reads the draft settings of the family its class path names (short or dotted)
    for class_path in ("DSparkModule", dspark):
        refuse_flat_settings(["--model.class_path", class_path, "--model.draft.block_chunk", "8"])
        with pytest.raises(ValueError, match="model.draft.block_size is now model.draft.config.block_size"):
            refuse_flat_settings(["--model.class_path", class_path, "--model.draft.block_size", "7"])


def _batch(B: int = 2, T: int = 40) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    loss_mask = torch.ones(B, T, dtype=torch.long)
    loss_mask[:, :9] = 0  # a prompt
    loss_mask[1, 30:] = 0  # a shorter second row
    return {"input_ids": torch.randint(0, 300, (B, T), generator=g), "attention_mask": torch.ones(B, T).long(),
            "loss_mask": loss_mask}  # fmt: skip


def _module(backend: str) -> DSparkModule:
    objective = DSparkObjectiveSettings(num_anchors=12, loss_backend=backend, loss_chunk=7)
    module = DSparkModule(TINY_TARGET, TINY_DRAFT, objective)
    module.configure_model()
    return module


def test_plain_and_chunked_steps_agree_in_value_and_gradients():
    plain, chunked = _module("plain"), _module("chunked")
    batch = _batch()
    for module in (plain, chunked):
        module.step_loss, module.step_blocks, _ = module.shared_step(batch, anchor_generator(0, 5, 0))
        module.step_loss.loss.backward()
    assert torch.equal(plain.step_blocks.valid, chunked.step_blocks.valid) and plain.step_blocks.valid.any()
    torch.testing.assert_close(chunked.step_loss.loss, plain.step_loss.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked.step_loss.tv, plain.step_loss.tv, rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in plain.draft.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().sum() > 0 for g in grads.values())
    for name, param in chunked.draft.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_targets_embedding_and_head_are_neither_trained_nor_saved():
    module = _module("chunked")
    module.shared_step(_batch(), anchor_generator(0, 0, 0))[0].loss.backward()
    target_params = list(module.source.parameters())
    assert target_params and all(not p.requires_grad and p.grad is None for p in target_params)
    state = module.state_dict()
    assert state and all(k.startswith("draft.") for k in state)
    assert not [k for k in state if "embed" in k or "lm_head" in k]
    trained = {id(p) for p in module.trainable_parameters()}
    assert trained == {id(p) for p in module.draft.parameters()}
    assert id(module.embedding()) not in trained


def test_anchors_depend_only_on_seed_step_and_rank():
    module, batch = _module("plain"), _batch()
    first = module.shared_step(batch, anchor_generator(0, 3, 0))[1]
    again = module.shared_step(batch, anchor_generator(0, 3, 0))[1]
    other = module.shared_step(batch, anchor_generator(0, 4, 0))[1]
    assert torch.equal(first.positions, again.positions) and not torch.equal(first.positions, other.positions)


# ---- the fit through cli.py -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_quickstart_dspark_fits_validates_and_exports(tmp_path):
    out = cli(tmp_path, "fit", "--config", str(dspark_config(tmp_path, "run", max_steps=4)))
    root = tmp_path / "run"
    assert "fit finished" in out and "val/tau_sim" in out
    metrics = (next((root / "logs").glob("version_*")) / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    for name in ("train/loss", "train/ce", "train/l1", "train/confidence", "train/accept_0", "train/tau_sim",
                 "val/tau_sim", "val/accept_3", "val/loss"):  # fmt: skip
        assert name in header, name
    drafter = load_dspark_export(root / "draft")  # our reader: every tensor, the config vLLM reads
    assert drafter.config.aux_layer_ids == [1, 3, 4] and drafter.config.block_size == 4
    ckpt = root / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=False)["global_step"] == 4
    validated = cli(tmp_path, "validate", "--config", str(dspark_config(tmp_path, "run", max_steps=4)),
                    "--ckpt_path", str(ckpt))  # fmt: skip
    assert "val/tau_sim" in validated

    printed = cli(tmp_path, "export", str(ckpt), str(tmp_path / "exported"), "--dtype", "float32")
    serve = next(line for line in printed.splitlines() if "vllm serve" in line)
    spec = json.loads(serve.split("--speculative-config ", 1)[1].strip("'"))
    assert spec["method"] == "dspark" and spec["num_speculative_tokens"] == 4
    assert spec["model"] == str(tmp_path / "exported")
    fit_export = load_file(str(root / "draft" / "model.safetensors"))
    cli_export = load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert fit_export.keys() == cli_export.keys()
    for key in fit_export:  # the last checkpoint is the final weights: the same drafter either way
        assert torch.equal(cli_export[key], fit_export[key]), key


@pytest.mark.slow
def test_resume_from_last_continues_exactly(tmp_path):
    cli(tmp_path, "fit", "--config", str(dspark_config(tmp_path, "full", max_steps=4, validate=False)))
    cut = dspark_config(tmp_path, "cut", max_steps=4, validate=False, stop_at=2)
    cli(tmp_path, "fit", "--config", str(cut))
    ckpt_dir = tmp_path / "cut" / "checkpoints"
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=False)["global_step"] == 2
    resumed = dspark_config(tmp_path, "cut", max_steps=4, validate=False)
    out = cli(tmp_path, "fit", "--config", str(resumed), "--ckpt_path", "last")
    assert "Restoring states from the checkpoint path" in out
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=False)["global_step"] == 4
    full = load_file(str(tmp_path / "full" / "draft" / "model.safetensors"))
    again = load_file(str(tmp_path / "cut" / "draft" / "model.safetensors"))
    assert full.keys() == again.keys()
    for key in full:
        torch.testing.assert_close(again[key], full[key], rtol=1e-5, atol=1e-6, msg=key)


def test_a_dspark_checkpoint_is_refused_by_an_eagle3_resume_and_back(tmp_path):
    from lightning_eagle import checkpoint_keys as keys

    module = _module("plain")
    record = module.checkpoint_record()
    recorded = {keys.DRAFT_FAMILY, keys.DRAFT_CONFIG, keys.DRAFT_TRAINING, keys.DRAFT_ORIGIN}
    assert record[keys.DRAFT_FAMILY] == "dspark" and set(record) == recorded
    assert record[keys.DRAFT_ORIGIN] is None  # a run that did not start from an earlier draft
    with pytest.raises(ValueError, match="names no draft family"):
        module.check_resume({})
    with pytest.raises(ValueError, match="holds a eagle3 draft and this run trains a dspark draft"):
        module.check_resume({keys.DRAFT_FAMILY: "eagle3", keys.DRAFT_CONFIG: {}})
    changed = dict(record[keys.DRAFT_CONFIG], block_size=7)
    with pytest.raises(ValueError, match="block_size: checkpoint 7, this run 4"):
        module.check_resume({**record, keys.DRAFT_CONFIG: changed})
    with pytest.raises(ValueError, match="block_size: checkpoint 7, this run 4"):  # the layout before: its own key
        module.check_resume({"dspark_draft_config": changed})
    module.check_resume(record)  # its own record continues
    # a checkpoint of the layout before: its own config key and the field names before one name per concept
    before = {("target_layer_ids" if k == "aux_layer_ids" else "aux_hidden_state_stream" if k == "aux_stream" else k): v
              for k, v in record[keys.DRAFT_CONFIG].items()}  # fmt: skip
    module.check_resume({"dspark_draft_config": before})


def test_the_command_line_picks_the_family(tmp_path):
    from lightning_eagle.commands.cli import make_cli

    config = dspark_config(tmp_path, "pick", max_steps=1)
    cli_ = make_cli(["--config", str(config), "--model.objective.num_anchors", "8"], False, run=False)
    assert isinstance(cli_.model, DSparkModule) and cli_.model.objective.num_anchors == 8
    with pytest.raises(ValueError, match="model.draft.block_size is now model.draft.config.block_size"):
        make_cli(["--config", str(config), "--model.draft.block_size", "7"], False, run=False)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--model.objective.num_anchors", "abc"], 'Parser key "model.objective.num_anchors": Expected a <class'),
        (["--model.objective.num_anchors", "0"], "model.objective.num_anchors must be an integer > 0, got 0"),
        (["--model.draft.block_size", "3"], "model.draft.block_size is now model.draft.config.block_size"),
    ],
)
def test_a_bad_dspark_option_is_one_error_line_naming_it(tmp_path, capsys, option, message):
    from lightning_eagle.commands.cli import main

    with pytest.raises(SystemExit):
        main(["fit", "--config", str(dspark_config(tmp_path, "bad", max_steps=1)), *option])
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] and message in err
    assert "Traceback" not in err and len([line for line in err.splitlines() if line.startswith("error:")]) == 1


def test_the_real_k3_dspark_config_parses(capsys):
    from lightning_eagle.commands.cli import main

    with pytest.raises(SystemExit):
        main(["fit", "--config", "kimi_k3_dspark", "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    model = printed["model"]
    assert model["class_path"].endswith("DSparkModule")
    assert model["init_args"]["target"]["aux_layer_ids"] == [1, 23, 45, 67, 89]
    assert model["init_args"]["draft"]["preset"] == "k3" and model["init_args"]["objective"]["num_anchors"] == 512
    assert printed["trainer"]["strategy"]["class_path"].endswith("ExpertParallelStrategy")
    # its memory plan: tests/planning/test_planning_memory_plan_dspark.py


def test_the_acceptance_callback_measures_a_dspark_run_with_block_decoding(tmp_path):
    """val/tau_real of a DSpark fit: the callback decodes through the draft family's loop (blocks of the module's
    block size, the drafter's own taps), greedy, so its output is the target's and tau_real is in [1, g + 1]."""
    import lightning.pytorch as pl
    from eagle_helpers import data_kwargs

    from lightning_eagle.data.datamodule import ChatDataModule
    from lightning_eagle.inference.callback import AcceptanceCallback

    module = DSparkModule(TINY_TARGET, TINY_DRAFT, DSparkObjectiveSettings(num_anchors=12))
    callback = AcceptanceCallback(num_prompts=2, max_new_tokens=8, compare_plain=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
                         max_steps=2, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0,
                         callbacks=[callback])  # fmt: skip
    trainer.fit(module, ChatDataModule(**data_kwargs(batch_size=2, max_length=96, draft_vocab_size=None)))
    report = callback.last_report
    assert report.num_draft_tokens == module.block_size and report.num_prompts == 2
    assert report.greedy_mismatches == 0
    assert 1.0 <= float(trainer.callback_metrics["val/tau_real"]) <= module.block_size + 1
    assert "val/vllm_mean_acceptance_length" in trainer.callback_metrics


def test_one_offline_step_equals_the_online_step(tmp_path):
    """The DSpark step from an fp32 dump (``cli.py dump`` of the same config: taps, post-norm teacher through the
    target's own final norm) equals the step against the online target, in value and gradients."""
    import lightning.pytorch as pl
    from eagle_helpers import data_kwargs

    from lightning_eagle.data.datamodule import ChatDataModule
    from lightning_eagle.features import HiddenStateDataModule
    from lightning_eagle.features.dump import dump_features

    data = data_kwargs(batch_size=2, max_length=96, draft_vocab_size=None)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))  # fmt: skip
    online = _module("plain")
    features = dump_features(online.target_spec, ChatDataModule(**data), tmp_path / "features", trainer,
                             dtype="float32", shard_rows=64)  # fmt: skip
    chats, dumped = ChatDataModule(**data), HiddenStateDataModule(str(features), batch_size=2)
    chats.setup("fit")
    dumped.setup("fit")
    online_batch, offline_batch = next(iter(chats.train_dataloader())), next(iter(dumped.train_dataloader()))
    for key in ("input_ids", "attention_mask", "loss_mask"):
        assert torch.equal(online_batch[key], offline_batch[key]), key
    objective = DSparkObjectiveSettings(num_anchors=12, loss_backend="plain")
    offline = DSparkModule(dataclasses.replace(TINY_TARGET, source="features"), TINY_DRAFT, objective)
    trainer.datamodule = dumped  # the module reads the manifest through trainer.datamodule
    offline._trainer = trainer
    offline.configure_model()
    results = []
    for module, batch in ((online, online_batch), (offline, offline_batch)):
        loss = module.shared_step(batch, anchor_generator(0, 0, 0))[0].loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in module.draft.named_parameters()}))
    (loss_on, grads_on), (loss_off, grads_off) = results
    torch.testing.assert_close(loss_off, loss_on, rtol=1e-5, atol=1e-6)
    for name, grad in grads_on.items():
        torch.testing.assert_close(grads_off[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_anchor_rows_are_counted_before_training_and_anchors_never_exceed_a_row(tmp_path, caplog):
    """Half the rows hold no anchor (supervised tokens, never two in a row): the run says how many train; the step
    samples at most T anchors a row however many are asked (what the memory plan counts)."""
    from lightning_eagle.data.datamodule import ChatDataModule
    from lightning_eagle.training.dspark_data import anchor_rows, check_anchor_rows

    rows = tmp_path / "rows.jsonl"
    lines = [{"input_ids": [256, 5, 6, 7, 8, 9], "loss_mask": [0, 1, 0, 1, 0, 1]},
             {"input_ids": [256, 5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 0, 0]}] * 2  # fmt: skip
    rows.write_text("".join(json.dumps(line) + "\n" for line in lines))
    data = ChatDataModule(train_files=[str(rows)], val_fraction=0.0, use_cache=False, batch_size=2)
    data.setup("fit")
    assert anchor_rows(data.train_dataset).sum().item() == 2
    with caplog.at_level("WARNING"):
        check_anchor_rows(data)
    assert (
        "2 of 4 training rows hold a DSpark anchor (two consecutive supervised tokens); the other 2 train nothing"
        in (caplog.text)
    )
    module = DSparkModule(TINY_TARGET, TINY_DRAFT, DSparkObjectiveSettings(num_anchors=8192, loss_backend="plain"))
    module.configure_model()
    batch = next(iter(data.train_dataloader()))
    _, blocks, keep = module.shared_step(batch, anchor_generator(0, 0, 0))
    assert keep.shape == (2, batch["input_ids"].shape[1])  # not 8192 blocks per row


def test_a_validation_epoch_without_a_block_is_an_error_not_tau_sim_0():
    """A streaming folder's rows are not checked before training: an evaluation that saw no block (no anchor in its
    rows) stops with the reason instead of logging val/tau_sim 0, below its minimum of 1."""
    from types import SimpleNamespace

    module = DSparkModule(TINY_TARGET, TINY_DRAFT, DSparkObjectiveSettings(num_anchors=4, loss_backend="plain"))
    module._trainer = SimpleNamespace(sanity_checking=False)
    with pytest.raises(
        ValueError, match=r"val: no DSpark block in 0 rows .* val/tau_sim would be 0, below its minimum"
    ):
        module._log_evaluation_metrics("val")
