"""The checkpoint half of :class:`~lightning_eagle.training.module.Eagle3Module`: a checkpoint holds the draft (with
its vocabulary map), its config and training settings, the target's fingerprint and rank 0's random streams — never
the target — and a resume refuses a checkpoint of another target, draft architecture or draft sharding."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from typing_extensions import override

from lightning_eagle.draft import build_draft
from lightning_eagle.draft.config import TRAINING_SETTINGS
from lightning_eagle.draft.export import CHECKPOINT_CONFIG_KEY, CHECKPOINT_TRAINING_KEY
from lightning_eagle.dtypes import DTYPES
from lightning_eagle.training.resume import (
    MICRO_BATCH_ROWS_KEY,
    micro_batch_rows,
    rescale_epoch_progress,
    rng_states_from_checkpoint,
    rng_states_to_checkpoint,
)

RNG_STATES_KEY = "eagle_rng_states"
DRAFT_SHARDED_KEY = "eagle_draft_sharded"
TARGET_FINGERPRINT_KEY = "eagle_target_fingerprint"


class DraftCheckpointing:
    """Mixed into ``Eagle3Module`` (a ``LightningModule``): ``state_dict`` / ``load_state_dict`` and the checkpoint
    hooks. Reads the module's ``draft``, ``draft_config``, ``hparams``, ``target_fingerprint`` and vocabulary map."""

    # ---- checkpoints: the draft only --------------------------------------------------------------------------------
    @override
    def state_dict(self, *args, **kwargs):
        state = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        drop = tuple(prefix + name for name in ("target.", "teacher_head.", "train_metrics.", "val_metrics."))
        for key in [k for k in state if k.startswith(drop)]:
            del state[key]
        return state

    @override
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Strict on the draft (missing or unexpected draft keys raise); the target is never in a checkpoint."""
        draft_state = {k[len("draft.") :]: v for k, v in state_dict.items() if k.startswith("draft.")}
        foreign = [k for k in state_dict if not k.startswith(("draft.", "train_metrics.", "val_metrics."))]
        if foreign:
            raise KeyError(f"checkpoint holds keys that are not the draft's: {foreign[:5]}")
        self._check_vocab_map(draft_state)
        if self.draft is None:  # configure_model never ran here (e.g. the fork/spawn launcher's main process)
            self.draft_config = self._draft_config(int(draft_state["d2t"].numel()))
            with torch.device("meta"):  # no random init: every tensor, vocab map included, comes from the state
                draft = build_draft(
                    self.draft_config,
                    attention_backend=self.hparams.attention_backend,
                    ttt_kv_cache=self.hparams.ttt_kv_cache,
                )
            result = draft.load_state_dict(draft_state, strict=True, assign=True)
            if self.draft_config.freeze_embeddings:
                draft.freeze_embeddings()
            self.draft = draft.to(dtype=DTYPES[self.hparams.draft_dtype])
            return result
        return self.draft.load_state_dict(draft_state, strict=True, assign=assign)

    def _check_vocab_map(self, draft_state: dict[str, torch.Tensor]) -> None:
        mapping = self._vocab_mapping()
        if mapping is None or "d2t" not in draft_state:
            return
        saved = draft_state["d2t"].cpu()
        if saved.shape != mapping.d2t.shape or not torch.equal(saved, mapping.d2t.cpu()):
            raise ValueError(
                "the checkpoint's draft vocabulary map (d2t) differs from the data module's: the draft's lm_head rows "
                "would mean other tokens. Use the same data/tokenizer/draft_vocab_size, or start a fresh run"
            )

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_CONFIG_KEY] = self.draft_config.to_dict()
        checkpoint[CHECKPOINT_TRAINING_KEY] = {
            "ttt_steps": self.hparams.ttt_steps,
            "step_decay": self.hparams.step_decay,
        }
        checkpoint[TARGET_FINGERPRINT_KEY] = self.target_fingerprint
        checkpoint[MICRO_BATCH_ROWS_KEY] = micro_batch_rows(self.trainer)
        checkpoint[DRAFT_SHARDED_KEY] = bool(self.hparams.draft_shard)
        # Rank 0's generators (the only checkpoint written): resumed ranks continue from the same random streams.
        checkpoint[RNG_STATES_KEY] = rng_states_to_checkpoint(
            _collect_rng_states(include_cuda=torch.cuda.is_available())
        )

    def _refuse_another_draft(self, saved: dict[str, Any] | None) -> None:
        """A resume continues the checkpoint's draft: any architecture field (layer type, sizes, aux taps and stream,
        norms, …) that differs is refused with both values (loading is not strict, so a changed architecture would
        otherwise restore what fits and silently switch the run's, and its export's, layer)."""
        if saved is None:
            return
        ours = self.draft_config.to_dict()
        # set by the data / training settings that checkpoints written before they left the draft config hold there
        training_only = {"draft_vocab_size", *TRAINING_SETTINGS}
        keys = sorted(saved, key=lambda k: (k != "architecture", k))  # the layer type first: it explains the rest
        changed = {k: (saved[k], ours.get(k)) for k in keys if k not in training_only and saved[k] != ours.get(k)}
        if changed:
            listed = "; ".join(f"{k}: checkpoint {a!r}, this run {b!r}" for k, (a, b) in changed.items())
            raise ValueError(
                f"the checkpoint's draft differs from this run's ({listed}): a resume cannot change the draft "
                "architecture; resume with the checkpoint's settings or start a new run (the checkpoint's export "
                "needs no resume: cli.py export CKPT DIR)"
            )

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if RNG_STATES_KEY in checkpoint and self._trainer is not None and self.trainer.state.fn == "fit":
            _set_rng_states(rng_states_from_checkpoint(checkpoint[RNG_STATES_KEY]))
        saved = checkpoint.get(TARGET_FINGERPRINT_KEY)
        if saved is not None and saved != self.target_fingerprint:
            raise ValueError(
                f"the checkpoint was trained against another target (config fingerprint {saved}, this target "
                f"{self.target_fingerprint} at {self.target_path})"
            )
        self._refuse_another_draft(checkpoint.get(CHECKPOINT_CONFIG_KEY))
        saved_sharded = checkpoint.get(DRAFT_SHARDED_KEY, False)
        if saved_sharded != bool(self.hparams.draft_shard):
            raise ValueError(
                f"the checkpoint was written with draft_shard={saved_sharded} and this run has "
                f"draft_shard={bool(self.hparams.draft_shard)}: their optimizer states are laid out differently; "
                f"resume with draft_shard={saved_sharded} (any world size of more than one rank if true)"
            )
        if self._trainer is not None:  # another world size or batch size: loop counters in this run's micro-batches
            rescale_epoch_progress(checkpoint, micro_batch_rows(self.trainer))
