"""Where a training step's target outputs come from, chosen once per run (``model.target.source``):

* :class:`OnlineTarget` — the frozen K3 runs every step (this rank's expert slice, placed by the strategy);
* :class:`DumpedFeatures` — the features of ``cli.py dump`` (``HiddenStateDataModule``); only the target's teacher
  head (``embed_tokens``, final norm, ``lm_head``) is loaded, and the dump is checked once against this run's target
  and taps.

Both answer the same three questions: the embedding the draft copies, a batch's ``(aux_hidden_states, post-norm
final hidden, lm_head weight)``, and the full ``lm_head`` for the teacher (gathered where the target is sharded).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_eagle.features.teacher_head import TeacherHead
from lightning_eagle.k3.capture import capture_taps
from lightning_eagle.k3.model import KimiK3ForCausalLM, set_token_chunk
from lightning_eagle.k3.target_spec import TargetSpec
from lightning_eagle.parallel.dense_shard import gathered_weight
from lightning_eagle.parallel.frozen_target import load_frozen_target
from lightning_eagle.run_settings import TargetSettings
from lightning_eagle.training.data_contract import features_manifest

TargetFeatures = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class TargetSource(nn.Module):
    """What the training step asks of the target, whichever source answers."""

    def embedding(self) -> torch.Tensor:
        """The target's input embedding (the draft's frozen copy is taken from it)."""
        raise NotImplementedError

    def features(self, batch: dict[str, torch.Tensor]) -> TargetFeatures:
        """``(aux_hidden_states [B,T,3H], post-norm final hidden [B,T,H], lm_head weight)`` of a batch."""
        raise NotImplementedError

    @contextlib.contextmanager
    def full_lm_head(self, weight: torch.Tensor) -> Iterator[torch.Tensor]:
        """``weight`` (the one :meth:`features` returned) whole, for the teacher's duration."""
        yield weight


class OnlineTarget(TargetSource):
    """The frozen K3, run without gradients and with autocast off (its fp32 router and softmax islands stay fp32)."""

    def __init__(self, model: KimiK3ForCausalLM, spec: TargetSpec, token_chunk: int | None) -> None:
        super().__init__()
        self.model = set_token_chunk(model, token_chunk)
        self.spec = spec

    def embedding(self) -> torch.Tensor:
        return self.model.model.embed_tokens.weight

    @torch.no_grad()
    def capture(self, batch: dict[str, torch.Tensor]):
        device_type = batch["input_ids"].device.type
        with torch.autocast(device_type=device_type, enabled=False):  # the spec's taps: validated once, not per batch
            return capture_taps(self.model, batch["input_ids"], batch["attention_mask"], self.spec.aux_layer_ids,
                                self.spec.aux_stream)  # fmt: skip

    def features(self, batch: dict[str, torch.Tensor]) -> TargetFeatures:
        cap = self.capture(batch)
        return cap.aux_hidden_states, cap.final_hidden, self.model.lm_head.weight

    @contextlib.contextmanager
    def full_lm_head(self, weight: torch.Tensor) -> Iterator[torch.Tensor]:
        with gathered_weight(self.model.lm_head) as full:  # dense-sharded target: gathered, else the weight itself
            yield full


class DumpedFeatures(TargetSource):
    """Features dumped by ``cli.py dump``; the pre-norm final hidden is normed here by the target's own final norm."""

    def __init__(self, head: TeacherHead, prenorm: bool) -> None:
        super().__init__()
        self.head, self.prenorm = head, prenorm

    def embedding(self) -> torch.Tensor:
        return self.head.embed_tokens

    def features(self, batch: dict[str, torch.Tensor]) -> TargetFeatures:
        dtype = self.head.lm_head.dtype
        final = self.head.final_hidden(batch["hidden_states"].to(dtype), stored_prenorm=self.prenorm)
        return batch["aux_hidden_states"].to(dtype), final, self.head.lm_head


def check_features_manifest(manifest: dict[str, Any] | None, settings: TargetSettings, spec: TargetSpec) -> None:
    """Features must come from this target with these taps; online runs must not be handed features."""
    features = settings.source == "features"
    if features != (manifest is not None):
        raise ValueError(
            "model.target.source='features' trains from dumped features: use data.class_path "
            "lightning_eagle.features.HiddenStateDataModule" if features else
            "the data module holds dumped features: set model.target.source='features' (no target forward)"
        )  # fmt: skip
    if not features:
        return
    where, aux_layer_ids = f"the features in {manifest['folder']}", list(spec.aux_layer_ids)
    if manifest["target"]["config_sha256"] != spec.fingerprint:
        raise ValueError(
            f"{where} were dumped from another target (config fingerprint {manifest['target']['config_sha256']}, "
            f"this target {spec.fingerprint} at {spec.path})"
        )
    if manifest["aux_layer_ids"] != aux_layer_ids or manifest["aux_stream"] != spec.aux_stream:
        raise ValueError(
            f"{where} tap layers {manifest['aux_layer_ids']} ({manifest['aux_stream']} stream), this module "
            f"trains on {aux_layer_ids} ({spec.aux_stream}): dump again or set model.target.aux_layer_ids / "
            "model.target.aux_stream to the dump's"
        )


def dumped_features(spec: TargetSpec, manifest: dict[str, Any] | None, device: torch.device) -> DumpedFeatures:
    """The teacher head of ``spec``'s checkpoint, for the dump ``manifest`` describes (pre- or post-norm hidden)."""
    prenorm = True if manifest is None else manifest["hidden_states"] == "prenorm"
    head = TeacherHead.from_checkpoint(spec.path, prenorm=prenorm, dtype=torch.float32)
    return DumpedFeatures(head.to(device=device, dtype=spec.torch_dtype), prenorm)


def target_source(owner, spec: TargetSpec, settings: TargetSettings, device: torch.device) -> TargetSource:
    """The source ``model.target.source`` names, for ``owner``'s rank: the frozen K3 placed by its strategy, or the
    teacher head of the run's dumped features."""
    if settings.source == "features":
        return dumped_features(spec, features_manifest(owner._trainer), device)
    return OnlineTarget(load_frozen_target(owner, spec), spec, settings.token_chunk)
