"""The docs hold together: every relative link in the repository's Markdown reaches a file (and a heading, when it
names an anchor), the README stays a short guide, and nothing points at the old measurement log, whose results now
live in docs/results.md and whose sections live in docs/log/."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parent.parent
README_MAX_LINES = 150
# the retired log's path, built in two pieces so that this file does not mention it
OLD_LOGS = ("docs/" + "performance.md", "performance_" + "grpo_step.md")  # the retired log's two files
SKIPPED_DIRS = {".git", "runs", "node_modules"}

# [text](target) and ![alt](target), the text allowed one level of nested brackets, an optional "title" after the target
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+).+?\1")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def markdown_files() -> list[Path]:
    """README.md, docs/**/*.md, tests/README.md and examples/**/*.md."""
    files = [REPO / "README.md", REPO / "tests" / "README.md"]
    for folder in ("docs", "examples"):
        files += sorted((REPO / folder).rglob("*.md"))
    return [f for f in files if f.is_file() and not _skipped(f.relative_to(REPO))]


def _skipped(relative: Path) -> bool:
    return any(part in SKIPPED_DIRS or part.startswith(".venv") for part in relative.parts)


def _lines_outside_fences(text: str):
    """(line number, line) for every line outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.split("\n"), start=1):
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
        elif fence is not None:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = None
        else:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, punctuation but hyphens and spaces dropped,
    spaces turned into hyphens."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", heading)  # a link reads as its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file; a repeated one gets -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in _lines_outside_fences(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base)
        seen[base] = 0 if count is None else count + 1
        found.add(base if count is None else f"{base}-{count + 1}")
    return found


def links(path: Path):
    """(line number, target) for every link in a Markdown file, outside code blocks and code spans."""
    for number, line in _lines_outside_fences(path.read_text(encoding="utf-8")):
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            yield number, match.group(1)


def broken_link(source: Path, target: str, anchor_cache: dict[Path, set[str]]) -> str | None:
    """Why a link does not resolve, or None when it does (or is not relative: a URL, a mail address)."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
        return None
    file_part, _, anchor = target.partition("#")
    resolved = (source.parent / unquote(file_part)).resolve() if file_part else source
    if not resolved.exists():
        return "no such file"
    if not anchor:
        return None
    if resolved.is_dir() or resolved.suffix.lower() != ".md":
        return "an anchor into something that is not a Markdown file"
    if resolved not in anchor_cache:
        anchor_cache[resolved] = anchors(resolved)
    if unquote(anchor) not in anchor_cache[resolved]:
        return "no heading with this anchor"
    return None


def test_the_markdown_files_are_found():
    names = {f.relative_to(REPO).as_posix() for f in markdown_files()}
    assert {"README.md", "tests/README.md", "docs/results.md", "docs/architecture.md"} <= names


def test_every_relative_link_reaches_its_file_and_heading():
    anchor_cache: dict[Path, set[str]] = {}
    broken = []
    for path in markdown_files():
        for number, target in links(path):
            reason = broken_link(path, target, anchor_cache)
            if reason:
                broken.append(f"{path.relative_to(REPO).as_posix()}:{number} -> {target} ({reason})")
    assert not broken, f"{len(broken)} broken link(s):\n" + "\n".join(broken)


def test_the_readme_is_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: measurements go to docs/results.md "
        "and docs/log/, guides to docs/"
    )


def _repository_files() -> list[Path]:
    """The files git tracks or would track (untracked but not ignored), as they are on disk."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout
        names = {name for name in out.decode("utf-8", "surrogateescape").split("\0") if name}
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file below the root
        names = {path.relative_to(REPO).as_posix() for path in REPO.rglob("*") if ".git" not in path.parts}
    return [REPO / name for name in sorted(names) if not _skipped(Path(name)) and (REPO / name).is_file()]


def test_no_file_points_at_the_retired_log():
    mentions = []
    for path in _repository_files():
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        for number, line in enumerate(data.decode("utf-8", "replace").split("\n"), start=1):
            if any(old in line for old in OLD_LOGS):
                mentions.append(f"{path.relative_to(REPO).as_posix()}:{number}")
    assert not mentions, (
        f"{' and '.join(OLD_LOGS)} are gone: link docs/results.md (results) or a docs/log/ file (method) instead, at:\n"
        + "\n".join(mentions)
    )


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("1. The engine against transformers' `generate`", "1-the-engine-against-transformers-generate"),
        ("10. vLLM (`rollout.name=vllm`) against the engine", "10-vllm-rolloutnamevllm-against-the-engine"),
        ("Results on SmolLM2-135M (this machine, fp32, 2 cores)", "results-on-smollm2-135m-this-machine-fp32-2-cores"),
        ("See [the guide](docs/x.md) now", "see-the-guide-now"),
    ],
)
def test_slug_follows_githubs_rule(heading, anchor):
    assert slug(heading) == anchor


def test_repeated_headings_are_numbered(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Log\n\n## Result\n\n```\n## Result\n```\n\n## Result\n\n## Result\n")
    assert anchors(page) == {"log", "result", "result-1", "result-2"}
    assert broken_link(tmp_path / "other.md", "page.md#result-2", {}) is None
    assert broken_link(tmp_path / "other.md", "page.md#result-3", {}) == "no heading with this anchor"
    assert broken_link(tmp_path / "other.md", "gone.md", {}) == "no such file"
    assert broken_link(tmp_path / "other.md", "https://example.com/x.md#y", {}) is None
