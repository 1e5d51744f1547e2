"""The one rule about validation files: never a training file (the same path, or the same bytes under another name);
``fit`` and ``data-report`` both refuse it."""

from __future__ import annotations

import filecmp
import os

from lightning_eagle.data.formats import expand_paths


def refuse_shared_files(train_files, val_files) -> None:
    """Validation on training rows measures memorisation, not acceptance: a validation file that is one of the
    training files (same path, or the same bytes under another name) is refused."""
    train = {os.path.realpath(f): f for f in expand_paths(train_files)}
    shared = []
    for f in expand_paths(val_files):
        real = os.path.realpath(f)
        same = real in train or any(
            os.path.getsize(real) == os.path.getsize(t) and filecmp.cmp(real, t, shallow=False) for t in train
        )
        if same:
            shared.append(f)
    if shared:
        raise ValueError(
            f"data.val_files {shared} are also training files (the same path or the same bytes as a file of "
            "data.train_files): val/tau would be measured on training rows; pass held-out files, or drop val_files "
            "to hold out data.val_fraction of the training rows"
        )
