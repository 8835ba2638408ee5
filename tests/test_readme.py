"""What users copy from the README and the docs: the quick start is the file the tests run, and nothing points at a
document outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import lightning_ft
from tests.helpers import REPO_ROOT

ROOT = Path(REPO_ROOT)


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", markdown, flags=re.M | re.S)


def test_the_readme_quick_start_is_examples_quickstart_py_verbatim():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = _python_blocks(section)
    assert blocks, "the quick start has no python block"
    assert blocks[0] == (ROOT / "examples" / "quickstart.py").read_text()
    # ...and says how to run it, as tests/e2e/test_first_hour.py does.
    assert "torchrun --standalone --nproc-per-node=2 examples/quickstart.py" in section


def test_the_readme_quick_start_says_what_a_run_writes_into_the_working_folder():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "`lightning-ft/`" in section and "lightning-ft/events/rank<N>.jsonl" in section
    assert "working folder" in section and "default_root_dir" in section


def test_the_readme_says_how_to_install_and_how_to_load_for_inference():
    readme = (ROOT / "README.md").read_text()
    install = readme.split("## Installation", 1)[1].split("\n## ", 1)[0]
    assert "pip install /path/to/lightning-ft" in install and "git+" in install
    assert "[cli]" in install and "[plot]" in install and "torch==2.13.0" in install
    assert "from lightning_ft import load_from_checkpoint" in readme
    assert "load_from_checkpoint" in lightning_ft.__all__


def test_docs_readme_changelog_and_code_point_at_nothing_outside_the_repository():
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += sorted((ROOT / "lightning_ft").rglob("*.py")) + sorted((ROOT / "examples").rglob("*.py"))
    offenders = [
        f"{path.relative_to(ROOT)}: {line.strip()}"
        for path in files
        for line in path.read_text().splitlines()
        if "DESIGN.md" in line or "../shared" in line
    ]
    assert offenders == []


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings of ``markdown``."""
    slugs = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, flags=re.M):
        slugs.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return slugs


def test_every_relative_link_in_the_docs_resolves():
    missing = []
    for path in [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "CHANGELOG.md",
        *sorted((ROOT / "docs").glob("*.md")),
    ]:
        for target, anchor in re.findall(r"\]\(([^)#:]*)(?:#([^)]*))?\)", path.read_text()):
            file = (path.parent / target) if target else path
            if not file.exists():
                missing.append(f"{path.relative_to(ROOT)} -> {target}")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                missing.append(f"{path.relative_to(ROOT)} -> {target}#{anchor}")
    assert missing == []
