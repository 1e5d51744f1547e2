"""The YAML configs shipped with the package (``configs/`` at the repository root is a link to this folder).

``--config quickstart`` or ``--config kimi_k3_eagle3`` on the command line names one of them; a path that exists
always wins over a packaged name.
"""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent


def packaged_configs() -> dict[str, Path]:
    return {p.stem: p for p in sorted(CONFIG_DIR.glob("*.yaml"))}


def resolve_config_path(value: str) -> str:
    """``value`` if it is an existing file (or not a packaged name), else the packaged config it names."""
    if Path(value).expanduser().exists():
        return value
    name = Path(value).name.removesuffix(".yaml")
    packaged = packaged_configs()
    if name in packaged and (Path(value).parent == Path(".") or Path(value).parent.name == "configs"):
        return str(packaged[name])
    return value
