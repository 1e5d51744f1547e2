"""Offline target features: dump the frozen K3's EAGLE-3 features once (``cli.py dump``), then train drafts from
them without the target (``HiddenStateDataModule`` + ``Eagle3Module`` with ``model.target.source: features``)."""

from lightning_eagle.features.datamodule import HiddenStateDataModule
from lightning_eagle.features.teacher_head import TeacherHead

__all__ = ["HiddenStateDataModule", "TeacherHead"]
