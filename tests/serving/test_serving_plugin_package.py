"""The vLLM plugin as packaged, without vLLM: declared where vLLM looks for it, named like the export, and never
imported by the library (vLLM's own loading of it runs in tests/engine/test_vllm_engine.py)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from lightning_eagle.draft import serving_format as fmt
from lightning_eagle.serving import vllm_plugin

REPO = Path(__file__).resolve().parents[2]


def test_entry_point_and_architecture_name():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    assert plugins == {"lightning_eagle": "lightning_eagle.serving.vllm_plugin:register"}
    assert vllm_plugin.ARCHITECTURE == fmt.ARCHITECTURE
    module, cls = vllm_plugin.MODEL_CLASS.split(":")
    assert cls == fmt.ARCHITECTURE and (REPO / (module.replace(".", "/") + ".py")).is_file()
    assert project["optional-dependencies"]["vllm"] == ["vllm==0.32.0"]


def test_the_library_never_imports_vllm():
    code = (
        "import sys, lightning_eagle, lightning_eagle.serving, lightning_eagle.serving.vllm_plugin, "
        "lightning_eagle.draft.export, lightning_eagle.cli; assert 'vllm' not in sys.modules, 'vllm imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
