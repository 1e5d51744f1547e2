"""Write the serving export of the draft when training ends (the quickstart ends with an exported draft), in its
family's serving layout (:class:`~lightning_eagle.draft.family.DraftFamily`'s ``export``)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from typing_extensions import override

from lightning_eagle.checkpoint_io import load_checkpoint_file
from lightning_eagle.draft.family import draft_family_named
from lightning_eagle.errors import RunError
from lightning_eagle.parallel.dense_shard import full_state_dict, has_sharded_trainable_parameters
from lightning_eagle.training.preemption import Interrupted, checkpoint_path, signal_name, signals_interrupt


class ExportDraftCallback(pl.Callback):
    """At the end of ``fit``, export the best checkpoint's draft (by the ``ModelCheckpoint`` monitor, e.g.
    ``val/tau_sim``) — or the current weights when there is none — to ``out_dir`` (atomic, overwrites).

    ``out_dir=None`` (default) = ``<trainer.default_root_dir>/draft``, so a run's outputs stay together. An
    FSDP2-sharded draft's current weights are gathered whole by every rank first.
    """

    def __init__(self, out_dir: str | None = None, use_best: bool = True, dtype: str | None = None) -> None:
        self.out_dir, self.use_best, self.dtype = (Path(out_dir) if out_dir else None), use_best, dtype

    def resolved_out_dir(self, trainer: pl.Trainer) -> Path:
        return self.out_dir if self.out_dir is not None else Path(trainer.default_root_dir) / "draft"

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module) -> None:
        """The export; a SIGTERM/SIGINT during it stops it at once (no partial folder is left: the write is atomic),
        saves the trained weights when no checkpoint holds them, and names the ``cli.py export`` command to rerun."""
        try:
            with signals_interrupt(lambda signum: Interrupted("", signum)):
                self._export(trainer, pl_module)
        except Interrupted as stop:
            raise self._interrupted(trainer, stop.signum) from None

    def _interrupted(self, trainer: pl.Trainer, signum: int) -> Interrupted:
        best = getattr(trainer.checkpoint_callback, "best_model_path", "") if self.use_best else ""
        if best and Path(best).is_file():
            source, saved = Path(best), ""
        else:  # the final weights, in a checkpoint the export command reads
            source, saved = checkpoint_path(trainer), " (saved now)"
            if trainer.world_size == 1:
                trainer.save_checkpoint(source, weights_only=False)
            elif not source.is_file():
                saved = " (if the run saved one; with several ranks none is saved now)"
        out = self.resolved_out_dir(trainer)
        dtype = f" --dtype {self.dtype}" if self.dtype else ""
        dtype += " --overwrite" if out.exists() else ""  # an older export stays there
        return Interrupted(
            f"fit's export stopped by {signal_name(signum)} after training ended (global step {trainer.global_step}): "
            f"nothing was exported to {out} (no partial folder left); the trained draft is in {source}{saved}; export "
            f"it with: cli.py export {source} {out}{dtype}",
            signum,
        )

    def _export(self, trainer: pl.Trainer, pl_module) -> None:
        import torch

        if trainer.global_step == 0:  # every rank: nothing was trained, so nothing is exported as if it had been
            raise RunError(
                "the run took no optimizer step (trainer.max_steps 0, no training rows, or stopped before the first "
                "step): there is no trained draft to export; nothing was exported"
            )
        source = pl_module
        best = getattr(trainer.checkpoint_callback, "best_model_path", "") if self.use_best else ""
        if best and Path(best).is_file():
            source = best
        if source is pl_module and has_sharded_trainable_parameters(pl_module):
            # an FSDP2-sharded draft: its whole tensors, gathered by every rank (a collective), kept by rank 0, in the
            # form of the checkpoint that would hold them
            source = {"state_dict": full_state_dict(pl_module), **pl_module.checkpoint_record()}
        if not trainer.is_global_zero:
            return
        dtype = getattr(torch, self.dtype) if self.dtype else None
        family, from_best = draft_family_named(pl_module.family, type(pl_module).__name__), isinstance(source, str)
        if from_best:
            source = load_checkpoint_file(source, weights_only=False)
        path = family.export(source, self.resolved_out_dir(trainer), dtype=dtype, overwrite=True)
        weights = "best checkpoint " + Path(best).name if from_best else "final"
        print(f"exported the draft ({weights} weights) to {path}")
