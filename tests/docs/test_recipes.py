"""Every shell recipe a page marks runnable (``<!-- runnable: name -->``) is run as written by a test.

No maintained pytest plugin runs shell blocks (pytest-markdown-docs runs Python only), so each recipe has a test that
runs it with bash from a fresh folder (tests/docs/markdown.py's ``run_recipe``) and checks what it prints against the
page's ``<!-- output: name -->`` block. This test holds the list: a page that marks a new recipe fails here until a
test runs it.
"""

from __future__ import annotations

from tests.docs.markdown import DOCS, ROOT, blocks

RUN_BY = {
    ("README.md", "quickstart"): "tests/e2e/test_first_hour.py",
    ("replica-groups.md", "replica-groups"): "tests/replica/test_replica_groups_recipe_e2e.py",
}
"""(page, recipe name) -> the test file that runs it."""


def _marked() -> set[tuple[str, str]]:
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md"))]
    return {(b.path.name, b.marker[1]) for p in pages for b in blocks(p) if b.marker and b.marker[0] == "runnable"}


def test_every_runnable_recipe_is_run_by_a_test_that_names_it():
    assert _marked() == set(RUN_BY)
    for (page, name), test in RUN_BY.items():
        source = (ROOT / test).read_text()
        assert f'"{name}"' in source and "run_recipe(" in source, f"{test} does not run {page}'s recipe {name!r}"


def test_every_runnable_recipe_is_a_bash_block_with_the_output_it_prints_on_the_same_page():
    for page, name in _marked():
        path = ROOT / page if (ROOT / page).exists() else DOCS / page
        (block,) = [b for b in blocks(path) if b.marker == ("runnable", name)]
        assert block.language == "bash", f"{page}: recipe {name!r} is a {block.language!r} block"
        assert [b for b in blocks(path) if b.marker == ("output", name)], f"{page}: no output block for {name!r}"
