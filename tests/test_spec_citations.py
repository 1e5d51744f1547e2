"""Every citation of a document points at something in the repository.

The code and the docs cite the design specs vendored in ``docs/spec/`` and the docs pages in these forms, in ``.py``
docstrings, comments and messages, ``.md`` pages, notebook cells and the shipped YAML configs:

* by section number: ```eagle3_training.md`` §8``, ``§1, §4, §6``, ``§4-§6`` (both ends), wrapped over lines;
* by quoted heading: ```dspark.md``, "Training, as implemented"`` (the heading starts with the quote; a spec's list
  item with that bold label counts too: ``* **Inference** (…)``), and ``README "Set-up"``;
* by bare name or path: ```dspark.md```, ``(dspark.md)``, ``docs/long_context.md``, ``../README.md``;
* Markdown links ``[text](docs/scaling.md#the-memory-plan)``: the file exists and the anchor is one of its headings.

A bare name is a spec in ``docs/spec/``, a top-level document (``README.md``, ``ARCHITECTURE.md``), a page of
``docs/`` or a file next to the citing one; a path exists relative to the citing file or the repository root. A cited
section is a heading of that file. So a citation never points nowhere (as the nine of ``dspark.md`` did before it was
vendored), nor outside the repository (``../shared/spec/…``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "spec"

SECTION = r"§\s?(\d+(?:\.\d+)*)"
# A document name or path ending in .md, not inside a URL or a longer path (no word, slash, dot, colon or dash before).
DOCUMENT = r"(?<![\w/.:-])((?:\.{1,2}/|[\w-]+/)*[\w-]+\.md)\b"
SECTIONS = rf"(?P<sections>,?\s*{SECTION}(?:\s*(?:,|-|–|/|and|&)\s*{SECTION})*)"
TITLE = r"(?:,\s*|\s+)[\"“](?P<title>[^\"”\n]{2,80})[\"”]"
CITATION = re.compile(rf"{DOCUMENT}[`*]*(?:{SECTIONS}|{TITLE})?")
README_TITLE = re.compile(r"\bREADME(?:'s)?,? [\"“](?P<title>[^\"”\n]{2,80})[\"”]")
LINK = re.compile(r"\[[^\]\n]*\]\((?P<target>[^)\s]+)\)")


def _sources() -> list[Path]:
    files = [ROOT / "cli.py", *ROOT.glob("*.md")]
    for folder in ("lightning_eagle", "tests", "benchmarks"):
        files += (ROOT / folder).rglob("*.py")
    files += (ROOT / "lightning_eagle" / "configs").glob("*.yaml")
    files += (ROOT / "notebooks").glob("*.ipynb")
    files += [p for p in (ROOT / "docs").rglob("*.md") if SPEC not in p.parents]
    # this file's own examples are data, not citations
    return sorted(p for p in files if "golden" not in p.parts and p != Path(__file__).resolve())


def _text(path: Path) -> str:
    """The file's text with line wraps (and the ``#`` of wrapped comments) folded into one space, so a citation
    broken over two lines still reads as one."""
    text = path.read_text()
    if path.suffix == ".ipynb":
        text = "\n".join("".join(cell["source"]) for cell in json.loads(text)["cells"])
    if path.suffix in (".py", ".yaml"):
        text = re.sub(r"[ \t]*\n[ \t]*#+[ \t]*", " ", text)
    return re.sub(r"[ \t]*\n[ \t]*", " ", text)


def _resolve(name: str, citing: Path) -> Path | None:
    candidates = [citing.parent / name, ROOT / name]
    if "/" not in name:
        candidates = [SPEC / name, *candidates, ROOT / "docs" / name]
    inside = [c.resolve() for c in candidates if c.is_file() and ROOT in c.resolve().parents]
    return inside[0] if inside else None


def _headings(path: Path) -> list[str]:
    return re.findall(r"^#{1,6} +(.+?) *#*$", path.read_text(), flags=re.MULTILINE)


def _plain(text: str) -> str:
    return re.sub(r"[`*]", "", text).strip().lower()


def _numbered(path: Path) -> set[str]:
    return {m.group(1) for h in _headings(path) if (m := re.match(r"(\d+(?:\.\d+)*)[. ]", h))}


def _has_title(path: Path, title: str) -> bool:
    want = _plain(title)
    for heading in _headings(path):
        plain = _plain(heading)
        if plain == want or (plain.startswith(want) and not plain[len(want)].isalnum()):
            return True
    labels = re.findall(r"^\s*(?:[*-]|\d+\.) \*\*([^*\n]+)\*\*", path.read_text(), flags=re.MULTILINE)
    return any(_plain(label) == want for label in labels)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes, repeats numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in _headings(path):
        slug = re.sub(r"[^\w\- ]", "", _plain(heading)).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def citations(text: str) -> list[tuple[str, tuple[str, ...], str | None]]:
    """(document, cited section numbers, cited heading) for every citation in ``text``."""
    found = []
    for m in CITATION.finditer(text):
        numbers = tuple(re.findall(SECTION, m.group("sections") or ""))
        found.append((m.group(1), numbers, m.group("title")))
    found += [("README.md", (), m.group("title")) for m in README_TITLE.finditer(text)]
    return found


def links(text: str) -> list[str]:
    """The local targets of the Markdown links in ``text`` (``scheme:`` URLs left out)."""
    return [m.group("target") for m in LINK.finditer(text) if not re.match(r"[a-z]+:", m.group("target"))]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("(`eagle3_training.md` §8)", ("eagle3_training.md", ("8",), None)),
        ("(``k3_target.md`` §5.2, ``x``)", ("k3_target.md", ("5.2",), None)),
        ("(`eagle3_training.md` §1, §4, §6, §7).", ("eagle3_training.md", ("1", "4", "6", "7"), None)),
        ("(`chat_and_loss_mask.md` §4-§6)", ("chat_and_loss_mask.md", ("4", "6"), None)),
        ("``lightning_notes.md`` §2–§10", ("lightning_notes.md", ("2", "10"), None)),
        ("mask (eagle3_training.md §4.3); ", ("eagle3_training.md", ("4.3",), None)),
        ('(`dspark.md`, "Training, as implemented")', ("dspark.md", (), "Training, as implemented")),
        ('spec ``dspark.md``, "Inference").', ("dspark.md", (), "Inference")),
        ("DeepSpec's (dspark.md): 512", ("dspark.md", (), None)),
        ("see [scaling](docs/scaling.md#the-memory-plan)", ("docs/scaling.md", (), None)),
        ('(README "Long context")', ("README.md", (), "Long context")),
        ('Path("docs") / "README.md").read_text()', ("README.md", (), None)),
    ],
)
def test_every_form_of_citation_is_read(text, expected):
    assert citations(text) == [expected]


def test_urls_and_longer_names_are_not_citations():
    assert citations("https://github.com/org/repo/blob/main/README.md and notes.mdx") == []


def test_a_citation_wrapped_over_comment_lines_is_read(tmp_path):
    source = tmp_path / "wrapped.py"
    source.write_text('# (`chat_and_loss_mask.md`\n# §1.5); (`dspark.md`, "Training,\n# as implemented")\n')
    assert citations(_text(source)) == [
        ("chat_and_loss_mask.md", ("1.5",), None),
        ("dspark.md", (), "Training, as implemented"),
    ]


def test_every_citation_points_at_a_document_and_section_that_exist():
    cited, missing = [], []
    for source in _sources():
        for name, numbers, title in citations(_text(source)):
            where = f"{source.relative_to(ROOT)}: {name}"
            target = _resolve(name, source)
            cited.append((name, numbers, title))
            if target is None:
                missing.append(f"{where}: no such file in docs/spec, docs/, the repository root or beside the citer")
                continue
            if absent := [n for n in numbers if n not in _numbered(target)]:
                missing.append(f"{where}: no section {', '.join('§' + n for n in absent)}")
            if title and not _has_title(target, title):
                missing.append(f'{where}: no heading "{title}"')
    assert not missing, "\n".join(missing)
    # the patterns still see how the code cites: numbered sections, quoted headings, and every vendored spec
    assert sum(1 for _, numbers, _ in cited if numbers) > 40
    assert sum(1 for _, _, title in cited if title) >= 8
    assert {name for name, _, _ in cited} >= {f.name for f in SPEC.glob("*.md")}


def test_every_markdown_link_resolves_with_its_anchor():
    broken = []
    for source in _sources():
        if source.suffix != ".md":
            continue
        for target in links(source.read_text()):
            path, _, anchor = target.partition("#")
            file = (source.parent / path).resolve() if path else source
            if not file.exists() or ROOT not in [file, *file.parents]:
                broken.append(f"{source.relative_to(ROOT)}: {target}: no such file in the repository")
            elif anchor and (file.suffix != ".md" or anchor not in _anchors(file)):
                broken.append(f"{source.relative_to(ROOT)}: {target}: no such heading")
    assert not broken, "\n".join(broken)
