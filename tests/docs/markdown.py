"""What the docs tests read in a Markdown page: its prose sentences, its code blocks and the markers before them.

A page marks its code blocks with an HTML comment on the line before the fence (GitHub and the site show neither):

- ``<!-- notest: why -->`` before a ``python`` block: a fragment (it needs a cluster, a GPU, a checkpoint of your own),
  shown but not run. Every other ``python`` block runs (tests/docs/test_python_blocks.py).
- ``<!-- runnable: name -->`` before a ``bash`` block: a recipe that runs as written, in a fresh folder; a test runs
  the block of that name (:func:`recipe`), and tests/docs/test_recipes.py fails for a marked block no test runs.
- ``<!-- output: name -->`` before a ``text`` block: lines the recipe ``name`` prints, in order; ``...`` in a line
  stands for any text.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import REPO_ROOT, subprocess_env

ROOT = Path(REPO_ROOT)
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<kind>notest|runnable|output)\s*(?::\s*(?P<value>.*?))?\s*-->\s*$")
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "approx.")


@dataclass(frozen=True)
class Block:
    """A fenced code block: its language (the first word of the info string), its text, the marker on the line
    before it (``("runnable", "quickstart")``, ``("notest", "needs a GPU")`` or ``None``) and its first line."""

    path: Path
    language: str
    text: str
    marker: tuple[str, str] | None
    line: int


def blocks(path: Path) -> list[Block]:
    """Every fenced code block of the page at ``path``."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m.group("fence"), len(m.group("indent"))
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        marker = _MARKER.match(lines[i - 1]) if i else None
        found.append(
            Block(
                path=path,
                language=(m.group("info").split() or [""])[0],
                text="".join(line[indent:] + "\n" for line in lines[i + 1 : end]),
                marker=(marker.group("kind"), marker.group("value") or "") if marker else None,
                line=i + 1,
            )
        )
        i = end + 1
    return found


def recipe(path: Path, name: str) -> str:
    """The ``bash`` block marked ``<!-- runnable: name -->`` in ``path`` (exactly one)."""
    (block,) = [b for b in blocks(path) if b.marker == ("runnable", name)]
    assert block.language in ("bash", "sh"), f"{path.name}:{block.line}: a runnable block is a bash block"
    return block.text


def run_recipe(path: Path, name: str, cwd: Path, *, timeout: float, **env: str) -> subprocess.CompletedProcess:
    """Run the recipe ``name`` of ``path`` as written, with bash (``-e``: a failing command fails it), in ``cwd``: the
    folder a reader runs it from. The venv's commands (``torchrun``, ``lightning-ft``) are on the ``PATH``, as after
    ``pip install``. Returns the finished process, stdout and stderr together in ``stdout``."""
    script = cwd / f".recipe-{name}.sh"
    script.write_text(recipe(path, name))
    run_env = subprocess_env(**env)
    run_env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + run_env.get("PATH", "")
    # Its own session, and its output in a file: when bash ends (or times out), what it left in the background (a
    # lighthouse after a failed step) is ended with it, and cannot hold the output open.
    output = cwd / f".recipe-{name}.out"
    with (
        output.open("w") as out,
        subprocess.Popen(
            ["bash", "-e", str(script)],
            cwd=cwd,
            env=run_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        ) as proc,
    ):
        try:
            proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, output.read_text(), None)


def expected_output(path: Path, name: str) -> list[str]:
    """The lines of the ``text`` block marked ``<!-- output: name -->`` in ``path``."""
    (block,) = [b for b in blocks(path) if b.marker == ("output", name)]
    return [line for line in block.text.splitlines() if line.strip()]


def assert_prints(output: str, expected: list[str]) -> None:
    """Each line of ``expected`` is a line of ``output``, in that order; ``...`` stands for any text."""
    lines = output.splitlines()
    at = 0
    for want in expected:
        pattern = re.compile(".*?".join(re.escape(part) for part in want.strip().split("...")))
        while at < len(lines) and not pattern.fullmatch(lines[at].strip()):
            at += 1
        assert at < len(lines), f"the output has no line {want!r} (after the earlier ones):\n{output[-4000:]}"
        at += 1


def prose(markdown: str) -> list[str]:
    """The paragraphs and list items of ``markdown``, each as one line: code blocks, tables, headings, HTML comments
    and admonition titles left out; links reduced to their text, inline code kept."""
    markdown = re.sub(r"<!--.*?-->", "", markdown, flags=re.S)
    out: list[str] = []
    current: list[str] = []
    fence = None

    def flush() -> None:
        if current:
            out.append(" ".join(current))
            current.clear()

    for raw in markdown.splitlines():
        line = re.sub(r"^>\s?", "", raw.strip())  # a quote (a box) is prose too
        if fence is not None:
            if line.startswith(fence):
                fence = None
            continue
        m = re.match(r"^(`{3,}|~{3,})", line)
        if m:
            flush()
            fence = m.group(1)
            continue
        if not line or line.startswith(("|", "#", "!!!", "???", "<", ":::")):
            flush()
            continue
        item = re.match(r"^([-*+]|\d+[.)])\s+", line)
        if item:
            flush()
            line = line[item.end() :]
        current.append(line)
    flush()
    return [re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", p) for p in out]


def sentences(markdown: str) -> list[str]:
    """The sentences of the prose of ``markdown``: a sentence ends at ``.``, ``!`` or ``?`` followed by a space and
    a capital, a digit, a quote, a backtick or an opening bracket (``e.g.`` and the like end none)."""
    found = []
    for paragraph in prose(markdown):
        start = 0
        for m in re.finditer(r"[.!?]\)?\s+(?=[A-Z0-9`\"'(\[*])", paragraph):
            head = paragraph[start : m.start() + 1]
            if head.lower().endswith(_ABBREVIATIONS):
                continue
            found.append(paragraph[start : m.end()].strip())
            start = m.end()
        if paragraph[start:].strip():
            found.append(paragraph[start:].strip())
    return found


def words(sentence: str) -> int:
    """Words of a sentence: whitespace-separated tokens with a letter or a digit (an arrow is no word)."""
    return sum(1 for token in sentence.split() if re.search(r"[A-Za-z0-9]", token))


@dataclass(frozen=True)
class Measure:
    words: int
    sentences: int
    median: float
    longest: int
    over_60: list[str]


def measure(path: Path) -> Measure:
    """Word count (all of the file, as ``wc -w``), and the sentences of its prose."""
    text = path.read_text()
    counts = [words(s) for s in sentences(text)]
    return Measure(
        words=len(text.split()),
        sentences=len(counts),
        median=statistics.median(counts) if counts else 0.0,
        longest=max(counts, default=0),
        over_60=[s for s in sentences(text) if words(s) > 60],
    )
