"""The documentation holds together: README.md stays short (at most 200 lines), every relative link in
README.md and docs/*.md reaches an existing file (and heading, for a link with an anchor), every page
under docs/ is linked from the README, and every TOML example in them is a valid run file."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_README_LINES = 200

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_LINK = re.compile(r"""<(?:a|img)\s[^>]*?(?:href|src)=["']([^"']+)["']""", re.I)
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.I)


def pages() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def links(page: Path) -> list[str]:
    text = prose(page.read_text(encoding="utf-8"))
    return [m.group(1) for pattern in (LINK, HTML_LINK) for m in pattern.finditer(text)]


def relative_links(page: Path) -> list[str]:
    return [link for link in links(page) if not EXTERNAL.match(link)]


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            base, n = slug(m.group(1)), 0
            while (candidate := base if n == 0 else f"{base}-{n}") in found:
                n += 1
            found.add(candidate)
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` that reach no file (or no heading of it), with why."""
    out = []
    for link in relative_links(page):
        path_part, _, anchor = link.partition("#")
        target = (page.parent / path_part).resolve() if path_part else page
        rel = target.relative_to(REPO).as_posix() if target.is_relative_to(REPO) else str(target)
        if not target.exists():
            out.append(f"{page.relative_to(REPO)}: {link} -> {rel} does not exist")
        elif anchor and target.suffix == ".md" and anchor.lower() not in anchors(target):
            out.append(f"{page.relative_to(REPO)}: {link} -> no heading #{anchor} in {rel}")
    return out


def test_readme_is_at_most_200_lines():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move reference material into docs/"


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_reaches_a_file(page):
    assert relative_links(page), f"{page.name} has no relative links: is the parser broken?"
    assert broken_links(page) == []


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(REPO / link.partition("#")[0]).resolve() for link in relative_links(README)}
    unlinked = [p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md") if p.resolve() not in linked]
    assert unlinked == [], f"docs pages the README does not link: {unlinked}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_toml_examples_are_valid_run_files(page):
    """Every TOML example is TOML, and (but for a package's pyproject.toml) a run file rlbus accepts: each
    key spelled as the typed run file has it, with a value of its type."""
    from services.launcher.runfile import RunFile
    from services.runtime.config import ConfigError

    for block in re.findall(r"^```toml\n(.*?)^```", page.read_text(encoding="utf-8"), re.S | re.M):
        try:
            tree = tomllib.loads(block)
        except tomllib.TOMLDecodeError as exc:
            pytest.fail(f"{page.relative_to(REPO)}: a TOML example does not parse ({exc}):\n{block}")
        if "project" in tree:  # a package's pyproject.toml (entry points), not a run file
            continue
        try:
            RunFile.from_tree(tree)
        except ConfigError as exc:
            pytest.fail(f"{page.relative_to(REPO)}: a TOML example is not a valid run file ({exc}):\n{block}")


def test_the_checker_finds_a_broken_link(tmp_path, monkeypatch):
    """The link checker itself: a link to a missing file and one to a missing heading are both reported."""
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Some heading\n", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md) [ok](docs/a.md#some-heading) `[code](not/a/link.md)`\n"
                    "[gone](docs/b.md) [no heading](docs/a.md#other) [web](https://example.org/x.md)\n",
                    encoding="utf-8")
    assert broken_links(page) == ["README.md: docs/b.md -> docs/b.md does not exist",
                                  "README.md: docs/a.md#other -> no heading #other in docs/a.md"]
