"""The README and the docs pages keep up with the tree: their links lead somewhere, and the README's Layout section
names every module of the package."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headers: lower case, punctuation dropped, spaces as hyphens."""
    headers = [line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", header.lower()).replace(" ", "-") for header in headers}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_local_link_leads_to_a_file_and_header_that_exist(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(target)
    assert not broken, f"{page.name} links to what is not there: {broken}"


def test_the_readme_layout_names_every_module() -> None:
    layout = REPO.joinpath("README.md").read_text().split("## Layout", 1)[1]
    modules = [
        path.relative_to(REPO)
        for folder in ("lightdist", "plugins")
        for path in (REPO / folder).rglob("*.py")
        if not path.name.startswith("__") and "__pycache__" not in path.parts
    ]
    unnamed = [str(module) for module in modules if f"`{module.name}`" not in layout]
    assert not unnamed, f"the README's Layout section does not say what these are: {unnamed}"
