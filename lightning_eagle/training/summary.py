"""The table printed when ``fit`` ends: what the run achieved and where its files are."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_eagle.training.export_callback import ExportDraftCallback


def _metric(trainer: pl.Trainer, name: str) -> str:
    value = trainer.callback_metrics.get(name)
    return "—" if value is None else f"{float(value):.3f}"


def fit_summary(trainer: pl.Trainer) -> str:
    """Best ``val/tau_sim`` (by the checkpoint monitor), the last ``val/tau_real``, and the output locations."""
    rows: list[tuple[str, str]] = [("steps", str(trainer.global_step))]
    ckpt = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)
    if ckpt is not None and ckpt.best_model_score is not None:
        rows.append((f"best {ckpt.monitor}", f"{float(ckpt.best_model_score):.3f}"))
    rows += [(f"last {n}", _metric(trainer, n)) for n in ("val/tau_sim", "val/tau_real", "val/loss")]
    if ckpt is not None:
        rows += [("best checkpoint", ckpt.best_model_path or "—"), ("last checkpoint", ckpt.last_model_path or "—")]
    export = next((c for c in trainer.callbacks if isinstance(c, ExportDraftCallback)), None)
    if export is not None:
        rows.append(("exported draft", str(export.resolved_out_dir(trainer))))
    if trainer.logger is not None and getattr(trainer.logger, "log_dir", None):
        rows.append(("logs (metrics.csv)", str(trainer.logger.log_dir)))
    width = max(len(k) for k, _ in rows)
    lines = ["", "fit finished", "-" * (width + 2 + max(len(v) for _, v in rows))]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)
