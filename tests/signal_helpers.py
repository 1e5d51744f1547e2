"""Used by ``tests/test_bad_inputs_signals.py`` inside its ``cli.py fit`` subprocesses (``tests/`` is on their
``PYTHONPATH``): callbacks that send this process a real signal at one stage of ``fit``, on cue, and write the time
they sent it to ``marker`` (so the test can tell how long the run took to stop)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from lightning.pytorch import Callback


class _SignalOnCue(Callback):
    def __init__(self, marker: str, signum: int = 15) -> None:
        self.marker, self.signum = marker, signum

    def send(self) -> None:
        Path(self.marker).write_text(str(time.time()))
        os.kill(os.getpid(), self.signum)


class SignalDuringTargetLoad(_SignalOnCue):
    """As the frozen target's load starts (``configure_model``, after every ``setup`` hook)."""

    def setup(self, trainer, pl_module, stage) -> None:
        from lightning_eagle.training import target_source

        load = target_source.load_frozen_target

        def loading(*args, **kwargs):
            self.send()
            return load(*args, **kwargs)

        target_source.load_frozen_target = loading


class SignalDuringAcceptance(_SignalOnCue):
    """As the acceptance decoding of the second prompt of the first validation inside ``fit`` starts (the sanity
    check decodes nothing): mid-validation, mid-decoding."""

    def setup(self, trainer, pl_module, stage) -> None:
        from lightning_eagle.inference.decoding_settings import DecodingSettings

        run, calls = DecodingSettings.run, []

        def decoding(settings, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                self.send()
            return run(settings, *args, **kwargs)

        DecodingSettings.run = decoding


class SignalDuringExport(_SignalOnCue):
    """While the fit-end export's folder is still a hidden ``.draft.*.partial`` folder (its files written, before it
    takes its name)."""

    def setup(self, trainer, pl_module, stage) -> None:
        from lightning_eagle import atomic

        fsync_tree = atomic.fsync_tree

        def syncing(path):
            if path.name.startswith(".draft.") and path.name.endswith(atomic.PARTIAL_SUFFIX):
                self.send()
            return fsync_tree(path)

        atomic.fsync_tree = syncing
