"""The README is the short way in and the ``docs/`` pages hold the rest: the README's set-up is the two commands (the
second is what CI runs), it shows both draft families side by side and links every docs page; the Python snippets of
the README and of every docs page run as written (a snippet that cannot run is a broken promise to a new user)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = sorted((ROOT / "docs").glob("*.md"))
TOPICS = ("data", "training", "serving", "acceptance", "scaling", "long_context", "offline", "families")
SNIPPETS = [
    (path.relative_to(ROOT), snippet)
    for path in [ROOT / "README.md", *PAGES]
    for snippet in re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
]


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_docs_have_python_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_docs_snippet_runs(index):
    where, snippet = SNIPPETS[index]
    exec(compile(snippet, f"{where} python block {index}", "exec"), {"__name__": "readme"})


def test_readme_fits_in_a_few_screens():
    assert len(README.splitlines()) <= 120


def test_readme_setup_is_the_two_commands_and_ci_runs_the_second():
    setup = README[README.index("## Set-up") :]
    install, tests = _blocks(setup, "bash")[0].strip().splitlines()
    assert install.startswith('pip install torch==2.13.0 && pip install -e ".[test]" && ')
    assert install.endswith("&& python cli.py fit --config configs/quickstart.yaml")
    assert tests == "python -m pytest tests notebooks"
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()
    # the quickstart's measured curve stays next to the command that produces it
    assert "2.6 → 4.1 → 4.7" in setup and "1.7 → 3.1 → 3.8" in setup


def test_readme_shows_the_two_families_side_by_side():
    families = README[README.index("## Two draft families") :]
    assert "| | EAGLE-3 (chains) | DSpark (blocks) |" in families
    assert "python benchmarks/family_comparison.py --steps 150" in families  # the protocol's measurement
    assert "| EAGLE-3 (chain, K = 7) | 3.18 | .59 .67 .83 .76 .90 .96 .91 | 2.48 | 4.4 | 109 s |" in families
    dspark = "| DSpark (block g = 7, 0.1 CE + 0.9 L1) | 2.28 | .53 .52 .63 .67 .71 .78 .64 | 1.99 | 3.3 | 324 s |"
    assert dspark in families
    assert "| DSpark, CE only (ablation) | 2.70 | .57 .57 .73 .82 .81 .79 .76 | 2.18 | 3.2 | 333 s |" in families
    assert "python cli.py fit --config configs/quickstart_dspark.yaml" in families


def test_readme_links_every_docs_page_and_every_topic_has_one():
    assert {f"docs/{t}.md" for t in TOPICS} <= {str(p.relative_to(ROOT)) for p in PAGES}
    linked = set(re.findall(r"\]\((docs/[\w/]+\.md)\)", README))
    assert {str(p.relative_to(ROOT)) for p in PAGES} - linked == set()


def test_every_docs_page_leads_back_to_the_readme():
    assert [p.name for p in PAGES if "(../README.md" not in p.read_text()] == []


def test_every_repository_file_a_page_names_exists():
    """A file path a page shows in backticks (``tests/parallel/test_x.py``, ``training/module.py`` under the package,
    ``configs/quickstart.yaml``) is a file of the repository: a moved module leaves no stale path behind."""
    folders = {p.name for p in (ROOT / "lightning_eagle").iterdir() if p.is_dir()}
    top = {"lightning_eagle", "tests", "benchmarks", "configs", "notebooks", "docs"}
    named, missing = [], []
    for page in [ROOT / "README.md", *PAGES]:
        for path in re.findall(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|yaml|ipynb|md|png|json))`", page.read_text()):
            if path.split("/")[0] in top | folders:
                named.append(path)
                if not any((base / path).is_file() for base in (ROOT, ROOT / "lightning_eagle")):
                    missing.append(f"{page.name}: {path}")
    assert missing == []
    assert len(named) >= 20  # the pattern still sees how the pages name files
