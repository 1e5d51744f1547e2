"""Continual training: a run's draft starts from the weights of an earlier draft (``model.draft.init_from``).

The start is an export folder (``config.json`` + weights, any family's serving layout) or a training checkpoint of
either family; only the trained weights are taken — the optimizer, its schedule and the loop counters start fresh,
and the frozen parts (an embedding copy, the vocabulary map) are this run's, made from its own target and data. The
usual case is a new post-trained target of the same shape (K3 → K3.1): drafts do not transfer across versions, and
continuing one costs a fraction of training it anew.

The start must be the same draft: its family, architecture, taps and vocabulary are compared with this run's, and a
difference is refused naming the fields and both values. Where the run started is recorded in its checkpoints and
exports (:data:`~lightning_eagle.checkpoint_keys.DRAFT_ORIGIN`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_eagle import checkpoint_keys as keys
from lightning_eagle.draft.family import checkpoint_draft_state, checkpoint_family, load_export

# config fields named by what a mismatch means (the rest are the architecture); never compared: the init's scale
TAP_FIELDS = ("aux_layer_ids", "aux_stream", "num_aux_hidden_states")
VOCABULARY_FIELDS = ("vocab_size", "draft_vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id")
NOT_COMPARED = ("initializer_range",)


@dataclass(frozen=True)
class DraftStart:
    """The draft a run starts from: where it is, its family and config, its tensors (training layout) and what it
    says of its own training (the target it was trained against, its step)."""

    path: str
    kind: str  # "export" or "checkpoint"
    family: str
    config: dict[str, Any]
    state: dict[str, torch.Tensor]
    target_fingerprint: str | None = None
    step: int | None = None

    def record(self) -> dict[str, Any]:
        """What a continued run's checkpoints and exports record of it."""
        return {"path": self.path, "kind": self.kind, "family": self.family,
                "target_fingerprint": self.target_fingerprint, "step": self.step}  # fmt: skip


def read_draft_start(path: str | Path) -> DraftStart:
    """The :class:`DraftStart` at ``path``: an export folder or a training checkpoint file (``ValueError`` naming the
    path otherwise)."""
    where = f"model.draft.init_from={str(path)!r}"
    path = Path(path)
    if path.is_dir():
        family, draft = load_export(path, None, torch.float32, "cpu")
        return DraftStart(str(path), "export", family.name, draft.config.to_dict(), draft.state_dict())
    if not path.is_file():
        raise ValueError(f"{where}: no such export folder or checkpoint file")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - a damaged or foreign file: one line that names it
        raise ValueError(f"{where}: not a readable training checkpoint ({type(err).__name__}: {err})") from None
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{where}: not a training checkpoint (a {type(checkpoint).__name__})")
    family = checkpoint_family(checkpoint, where)
    config = checkpoint.get(keys.DRAFT_CONFIG)
    if not isinstance(config, dict):
        raise ValueError(f"{where}: the checkpoint records no draft config ({keys.DRAFT_CONFIG!r})")
    return DraftStart(
        str(path), "checkpoint", family.name, config, checkpoint_draft_state(checkpoint),
        checkpoint.get(keys.TARGET_FINGERPRINT), checkpoint.get("global_step"),
    )  # fmt: skip


def check_same_draft(start: DraftStart, family: str, config: dict[str, Any]) -> None:
    """Refuse a start of another family, architecture, taps or vocabulary than this run's draft (``config``)."""
    where = f"model.draft.init_from={start.path!r}"
    if start.family != family:
        raise ValueError(
            f"{where} holds a {start.family} draft and this run trains a {family} draft: a run continues a draft of "
            "its own family (set model.class_path to the start's family, or leave init_from unset)"
        )
    changed = {k: (start.config.get(k), config.get(k)) for k in sorted(set(start.config) | set(config))
               if k not in NOT_COMPARED and start.config.get(k) != config.get(k)}  # fmt: skip
    for what, fields in (("taps", TAP_FIELDS), ("vocabulary", VOCABULARY_FIELDS), ("architecture", None)):
        named = {k: v for k, v in changed.items() if (k in fields if fields else True)}
        if named:
            listed = "; ".join(f"{k}: start {a!r}, this run {b!r}" for k, (a, b) in named.items())
            raise ValueError(
                f"{where}: the start's {what} {'differ' if what == 'taps' else 'differs'} from this run's ({listed}); "
                f"continual training keeps the "
                f"draft's {what} — set this run's to the start's, or train a new draft"
            )


@torch.no_grad()
def start_draft_from(draft: torch.nn.Module, start: DraftStart) -> None:
    """Copy ``start``'s trained weights into ``draft`` (whole, before any sharding). Its frozen parameters (an
    embedding copy of this run's target) stay; a buffer (the vocabulary map) must equal this run's."""
    where = f"model.draft.init_from={start.path!r}"
    params = dict(draft.named_parameters())
    trained = {n for n, p in params.items() if p.requires_grad}
    missing = sorted(trained - set(start.state))
    if missing:
        raise ValueError(f"{where}: the start has no {', '.join(missing[:4])} (this run's draft trains them)")
    for name, buffer in draft.named_buffers():
        saved = start.state.get(name)
        if saved is not None and (saved.shape != buffer.shape or not torch.equal(saved.to(buffer), buffer)):
            raise ValueError(
                f"{where}: the start's {name} (its vocabulary map) differs from this run's data module's: the "
                "draft's rows would mean other tokens; use the start's data/tokenizer/draft_vocab_size"
            )
    for name in sorted(trained):
        value, param = start.state[name], params[name]
        if value.shape != param.shape:
            raise ValueError(f"{where}: {name} has shape {tuple(value.shape)}, this run's draft {tuple(param.shape)}")
        param.copy_(value.to(param.dtype))
