"""Used by the kill -9 test inside its ``cli.py fit`` subprocess (``tests/`` is on its ``PYTHONPATH``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from lightning_eagle.checkpoint_io import AtomicCheckpointIO


class StallingCheckpointIO(AtomicCheckpointIO):
    """Stalls the save whose file name contains ``$STALL_AT`` after its bytes are written but before it takes its
    final name, and announces it by creating ``$STALL_MARKER``: the test kills the process right then."""

    def before_publish(self, tmp: Path, final: Path) -> None:
        if os.environ.get("STALL_AT", "\0") in final.name:
            Path(os.environ["STALL_MARKER"]).write_text(str(tmp))
            time.sleep(120)
