"""The documentation stays true and findable: the configuration page is what the settings
generate and lists every flag `python -m service --help` prints; the README is at most 120
lines and its relative links and anchors resolve; every page is in the site's navigation; no
page points outside the repository. `make docs` builds the site strictly (broken links in docs/ fail)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml
from markdown.extensions.toc import slugify

from scripts import config_doc

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.M)
ANCHOR = re.compile(r"""<a id=["']([^"']+)["']""")


def test_the_configuration_page_is_generated_from_the_settings() -> None:
    assert (DOCS / "configuration.md").read_text() == config_doc.render(), (
        "docs/configuration.md is stale: run `python -m scripts.config_doc` (make config-doc)"
    )


def test_every_flag_and_variable_of_the_help_is_on_the_configuration_page() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "service", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"COLUMNS": "200", "PATH": ""},
    ).stdout
    flags = set(re.findall(r"^  (--[a-z][a-z0-9-]*[a-z0-9])", shown, re.M)) - {"--help"}
    variables = set(re.findall(r"\[env\s+(ATTENTION_[A-Z0-9_]+);", shown))
    assert len(flags) == len(variables) > 30
    page = (DOCS / "configuration.md").read_text()
    missing = sorted(f for f in flags if f"`{f}`" not in page)
    missing += sorted(v for v in variables if f"`{v}`" not in page)
    assert not missing, f"not on docs/configuration.md: {missing}"


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {slugify(h, "-") for h in HEADING.findall(text)} | set(ANCHOR.findall(text))


def _broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no {resolved.relative_to(ROOT)}")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    return broken


def test_the_readme_is_a_short_front_door_whose_links_resolve() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 120, f"README.md has {len(lines)} lines; topics belong in docs/"
    assert not _broken_links(README), _broken_links(README)
    assert "docs/index.md" in README.read_text() or "docs/" in README.read_text()


def test_every_page_is_in_the_navigation() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, str):
            listed.add(node)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(config["nav"])
    pages = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md")}
    assert pages <= listed, f"pages missing from mkdocs.yml nav: {sorted(pages - listed)}"


def test_no_page_points_outside_the_repository() -> None:
    for page in [README, ROOT / "CHANGELOG.md", *DOCS.rglob("*.md")]:
        text = page.read_text()
        for needle in ("DESIGN.md", "STYLE.md", "shared/"):
            assert needle not in text, f"{page.relative_to(ROOT)} mentions {needle}"
