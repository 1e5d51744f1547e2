"""The family seam holds: a third draft family defined entirely in this file — a toy drafter (the target's taps at the
last verified position → first token, a bigram table for the rest) with its own config, settings, LightningModule,
export layout and decoding record — runs ``fit`` → checkpoint → resume → ``export`` → ``acceptance`` through the
library's own commands with no edit to any library file. The export and acceptance commands run in a fresh process
that finds the family through ``LIGHTNING_EAGLE_FAMILIES`` alone."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

from lightning_eagle import checkpoint_keys as keys
from lightning_eagle.atomic import atomic_dir
from lightning_eagle.draft.family import DRAFT_FAMILIES, DraftFamily, draft_family_named, register_draft_family
from lightning_eagle.inference.decoding_family import DECODING_FAMILIES, DecodingFamily, register_decoding_family
from lightning_eagle.inference.drafter import DraftProposal
from lightning_eagle.inference.speculative import speculative_generate
from lightning_eagle.k3.target_spec import TargetSpec
from lightning_eagle.parallel.frozen_target import root_device
from lightning_eagle.run_settings import DraftTrainingSettings, OptimizationSettings, TargetSettings
from lightning_eagle.training.draft_checkpoint import draft_state
from lightning_eagle.training.draft_training import TRAINING_FAMILIES, DraftTrainingModule
from lightning_eagle.training.target_source import target_source

REPO = Path(__file__).resolve().parents[2]
FAMILY = "toy_bigram"
ARCHITECTURE = "ToyBigramDrafter"
pytestmark = pytest.mark.slow
frozen = dataclasses.dataclass(frozen=True)


# ---- the draft layer: config, drafter, export ---------------------------------------------------------------------
@frozen
class ToyConfig:
    vocab_size: int
    hidden_size: int
    aux_layer_ids: tuple[int, ...]
    aux_stream: str = "prefix"

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "aux_layer_ids": list(self.aux_layer_ids)}

    @classmethod
    def from_dict(cls, data: dict) -> ToyConfig:
        return cls(**{**data, "aux_layer_ids": tuple(data["aux_layer_ids"])})


class ToyDrafter(nn.Module):
    """Implements the chain loop's Drafter protocol (reset / extend / propose)."""

    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.config = config
        self.proj = nn.Linear(len(config.aux_layer_ids) * config.hidden_size, config.vocab_size)
        self.bigram = nn.Embedding(config.vocab_size, config.vocab_size)
        self.register_buffer("selected_token_ids", torch.arange(config.vocab_size), persistent=False)
        self.aux_layer_ids, self.aux_stream = list(config.aux_layer_ids), config.aux_stream
        self._last: torch.Tensor | None = None

    def forward(self, aux: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.proj(aux), self.bigram(input_ids)

    def reset(self) -> None:
        self._last = None

    def extend(self, aux_hidden_states: torch.Tensor, next_ids: torch.Tensor) -> None:
        self._last = aux_hidden_states[0, -1]

    def propose(self, num_tokens, temperature, generator, top_p=1.0) -> DraftProposal:
        logits, tokens, all_logits, all_probs = self.proj(self._last.to(self.proj.weight.dtype)), [], [], []
        for _ in range(num_tokens):
            probs = F.softmax(logits.float() / temperature, -1) if temperature > 0 else None
            token = torch.multinomial(probs, 1, generator=generator)[0] if probs is not None else logits.argmax()
            tokens.append(token), all_logits.append(logits), all_probs.append(probs)
            logits = self.bigram(token)
        stacked = torch.stack(tokens) if tokens else torch.zeros(0, dtype=torch.long)
        return DraftProposal(stacked, stacked, torch.stack(all_probs) if temperature > 0 and tokens else None,
                             torch.stack(all_logits) if tokens else torch.zeros(0, self.config.vocab_size))  # fmt: skip


def _export(source, out_dir, *, dtype=None, overwrite=False, include_embeddings=None) -> Path:
    if isinstance(source, dict):  # a training checkpoint: the family's config under the shared key
        drafter = ToyDrafter(ToyConfig.from_dict(source[keys.DRAFT_CONFIG]))
        drafter.load_state_dict(draft_state(source["state_dict"]))
    else:
        drafter = getattr(source, "draft", source)
    tensors = {k: v.detach().to(dtype or v.dtype).contiguous().clone() for k, v in drafter.state_dict().items()}
    with atomic_dir(Path(out_dir), overwrite=overwrite, replaceable=lambda folder: None) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps({"architectures": [ARCHITECTURE], **drafter.config.to_dict()}))
    return Path(out_dir)


def _load_export(folder, target, dtype, device) -> ToyDrafter:
    data = json.loads((Path(folder) / "config.json").read_text())
    drafter = ToyDrafter(ToyConfig.from_dict({k: v for k, v in data.items() if k != "architectures"}))
    drafter.load_state_dict(load_file(str(Path(folder) / "model.safetensors")))
    return drafter.to(device=device, dtype=dtype)


# ---- the training layer: settings and the LightningModule ---------------------------------------------------------
@frozen
class ToyDraftSettings(DraftTrainingSettings):  # dtype, shard, init_seed, master weights, init_from: every family's
    bigram_rank: int = 0  # a family's own draft setting: never mistaken for an old flat key


@frozen
class ToyObjectiveSettings:
    tokens_ahead: int = 3


class ToyModule(DraftTrainingModule):
    family = FAMILY
    settings_groups = {"target": TargetSettings, "draft": ToyDraftSettings, "objective": ToyObjectiveSettings,
                       "optimization": OptimizationSettings}  # fmt: skip

    def __init__(self, target: TargetSettings = TargetSettings(), draft: ToyDraftSettings = ToyDraftSettings(),
                 objective: ToyObjectiveSettings = ToyObjectiveSettings(),
                 optimization: OptimizationSettings = OptimizationSettings()) -> None:  # fmt: skip
        super().__init__({"target": target, "draft": draft, "objective": objective, "optimization": optimization})

    @classmethod
    def run_spec(cls, groups, config=None):
        spec = TargetSpec.from_settings(groups["target"], config=config, tap_count=None)
        text = spec.config
        return spec, ToyConfig(text.vocab_size, text.hidden_size, tuple(spec.aux_layer_ids), spec.aux_stream)

    @property
    def num_draft_tokens(self) -> int:
        return self.objective.tokens_ahead

    def refuse_unsupported_run(self, stage: str) -> None:
        pass

    def configure_model(self) -> None:
        if self.draft is not None:
            return
        self.source = target_source(self, self.target_spec, self.target_settings, root_device(self))
        torch.manual_seed(self.draft_settings.init_seed)
        self.draft = ToyDrafter(self.draft_config).to(root_device(self))

    def _loss(self, batch) -> torch.Tensor:
        aux, _, _ = self.source.features(batch)
        first, bigram = self.draft(aux[:, :-1], batch["input_ids"][:, :-1])
        nxt, mask = batch["input_ids"][:, 1:], batch["loss_mask"][:, 1:].float()
        ce = F.cross_entropy(first.flatten(0, 1), nxt.flatten(), reduction="none") + F.cross_entropy(
            bigram.flatten(0, 1), nxt.flatten(), reduction="none"
        )
        return (ce * mask.flatten()).sum() / mask.sum().clamp(min=1)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self._loss(batch))

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if self.draft is None:
            self.draft = ToyDrafter(self.draft_config)
        return self.draft.load_state_dict(draft_state(state_dict), strict=True)


# ---- the records ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _unregistered_after():
    """The toy family leaves the registries with this file's tests (the suite's other tests see only the built-ins)."""
    yield
    for registry in (DRAFT_FAMILIES, DECODING_FAMILIES, TRAINING_FAMILIES):
        registry.pop(FAMILY, None)


if FAMILY not in DRAFT_FAMILIES:  # once per process (pytest and a command may both import this file)
    register_draft_family(DraftFamily(
        name=FAMILY, config_type=ToyConfig, is_draft=lambda d: isinstance(d, ToyDrafter),
        recognizes=lambda c: c.get("architectures") == [ARCHITECTURE], load_export=_load_export, export=_export,
        serve_lines=lambda config_json, folder: [f"{folder}: a toy family, served by no engine"],
        aux_layer_ids=lambda config: list(config.aux_layer_ids),
    ))  # fmt: skip
    register_decoding_family(DecodingFamily(FAMILY, speculative_generate, lambda d: 3))


# ---- the proof ------------------------------------------------------------------------------------------------------
def _config(tmp_path: Path, max_steps: int) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": max_steps, "val_check_interval": 2,
            "limit_val_batches": 1, "check_val_every_n_epoch": None, "enable_progress_bar": False,
            "default_root_dir": str(tmp_path / "run"), "log_every_n_steps": 1,
            "callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"every_n_train_steps": 2, "save_top_k": -1, "save_last": True}},
                {"class_path": "lightning_eagle.training.export_callback.ExportDraftCallback",
                 "init_args": {"use_best": False}},
                {"class_path": "lightning_eagle.inference.callback.AcceptanceCallback",
                 "init_args": {"num_prompts": 2, "max_new_tokens": 6}},
            ],
        },
        "model": {
            "class_path": f"{__name__}.ToyModule",
            "init_args": {"target": {"path": "quickstart", "aux_layer_ids": [1, 5], "dtype": "float32"},
                          "draft": {"bigram_rank": 4}, "optimization": {"lr": 3e-3}},
        },
        "data": {**yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())["data"], "max_length": 96,
                 "batch_size": 2, "draft_vocab_size": None},
    }  # fmt: skip
    path = tmp_path / f"toy{max_steps}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _command(tmp_path: Path, *words: str) -> str:
    """``cli.py WORDS`` in a fresh process that knows the family only from ``LIGHTNING_EAGLE_FAMILIES``."""
    env = {**os.environ, "LIGHTNING_EAGLE_FAMILIES": __name__, "LIGHTNING_EAGLE_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(REPO / "tests"), str(REPO)])}  # fmt: skip
    done = subprocess.run([sys.executable, str(REPO / "cli.py"), *words], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout + done.stderr


def test_a_third_family_runs_fit_resume_export_acceptance_without_a_library_edit(tmp_path, monkeypatch):
    from lightning_eagle.commands.cli import main as cli_main

    monkeypatch.setenv("LIGHTNING_EAGLE_CACHE", str(tmp_path / "cache"))
    cli_main(["fit", "--config", str(_config(tmp_path, 2))])
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint[keys.DRAFT_FAMILY] == FAMILY and checkpoint[keys.DRAFT_CONFIG]["aux_layer_ids"] == [1, 5]
    assert {k for k in checkpoint if k.startswith("eagle_") or k.startswith("dspark_")} == set()
    metrics = (tmp_path / "run" / "logs").rglob("metrics.csv")
    assert any("val/tau_real" in m.read_text() for m in metrics)  # the acceptance callback decoded the toy draft

    # resume for two more steps: the run continues from the checkpoint's step
    cli_main(["fit", "--config", str(_config(tmp_path, 4)), "--ckpt_path", str(tmp_path / "run" / "checkpoints" /
              "last.ckpt")])  # fmt: skip
    resumed = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert resumed["global_step"] == 4
    fit_export = _load_export(tmp_path / "run" / "draft", None, torch.float32, "cpu")

    out = _command(tmp_path, "export", str(tmp_path / "run" / "checkpoints" / "last.ckpt"), str(tmp_path / "export"))
    assert f"(a {FAMILY} draft)" in out and "a toy family, served by no engine" in out
    exported = _load_export(tmp_path / "export", None, torch.float32, "cpu")
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, fit_export.state_dict()[name]), name  # the fit-end export is the last checkpoint's

    out = _command(tmp_path, "acceptance", "--target", "quickstart", "--draft", str(tmp_path / "export"),
                   "--num-prompts", "2", "--max-new-tokens", "6", "--temperature", "0", "--no-plain")  # fmt: skip
    assert "rounds" in out and "K 3," in out and "vLLM: mean acceptance length" in out, out[-2000:]  # the family's K
    assert draft_family_named(FAMILY).name == FAMILY


def test_a_family_without_a_memory_plan_is_refused_by_the_plan_by_name(tmp_path, capsys):
    from lightning_eagle.commands.cli import main as cli_main

    with pytest.raises(SystemExit):
        cli_main(["memory-plan", "--config", str(_config(tmp_path, 2))])
    assert f"draft family '{FAMILY}' registers no memory plan" in capsys.readouterr().err
