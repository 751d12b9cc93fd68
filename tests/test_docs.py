"""The documentation holds together: its links resolve, the README stays short, and every cited Note exists.

- Every relative link of ``README.md`` and ``docs/**/*.md`` (``[text](path)``, ``[text](path#anchor)``,
  ``[text](#anchor)``, images and ``[label]: path`` definitions), outside code, names an existing file, and its
  ``#anchor`` a heading of the target under GitHub's slug rules; ``http(s)`` links are checked for form only.
- ``README.md`` is under 250 lines (the manual lives in ``docs/``).
- Every Note the code, scripts, tests and docs cite (the word Note, a space, then the name in square brackets) is
  defined somewhere: a line holding only that citation (optionally as a ``#`` comment) with a line of ``~`` under it.

Pure Python: no torch, no process groups.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NOTE_FOLDERS = ("mesh_cp", "integrations", "scripts", "tests", "docs", "examples")

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
URL = re.compile(r"^https?://[A-Za-z0-9.-]+\.[A-Za-z]{2,}(:\d+)?(/\S*)?$")

NOTE_CITE = re.compile(r"Note \[([^\]]+)\]")
# A citation may wrap: "Note" or part of the name at the end of a line, the rest on the next (after indentation
# and a comment marker).
NOTE_CITE_WRAPPED = re.compile(r"Note(?:[ \t]+|[ \t]*\n[ \t]*(?:#[ \t]*)?)\[([^\]\n]*(?:\n[^\]\n]*)?)\]")
WRAP = re.compile(r"[ \t]*\n[ \t]*(?:#[ \t]*)?")
NOTE_DEF = re.compile(r"^\s*(?:#\s*)?(?:[rR]?\"\"\"\s*)?Note \[([^\]]+)\]\s*$")
NOTE_RULE = re.compile(r"^\s*(?:#\s*)?~+\s*$")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def prose_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of the lines outside fenced code blocks, with inline code spans blanked."""
    fence = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = FENCE.match(line)
        if match:
            marker = match.group(1)
            if fence is None:
                fence = marker
            elif marker == fence:
                fence = None
            continue
        if fence is None:
            yield number, INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: link text kept, lowercase, punctuation but ``-`` and ``_`` dropped,
    spaces to ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a markdown file: heading slugs (repeats numbered ``-1``, ``-2``, ... as GitHub does)
    and explicit ``<a name=...>`` / ``<a id=...>``."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    fence = None
    for line in path.read_text(encoding="utf-8").splitlines():
        match = FENCE.match(line)
        if match:
            fence = match.group(1) if fence is None else (None if match.group(1) == fence else fence)
            continue
        if fence is not None:
            continue
        found.update(HTML_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> Iterator[tuple[int, str]]:
    for number, line in prose_lines(path):
        for target in INLINE_LINK.findall(line):
            yield number, target
        definition = REFERENCE_DEF.match(line)
        if definition:
            yield number, definition.group(1)


def broken_link(source: Path, target: str) -> str | None:
    """Why ``target`` (a link in ``source``) is broken, or ``None``."""
    if target.startswith(("http://", "https://")):
        return None if URL.match(target) else "malformed URL"
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):
        return None if target.startswith("mailto:") else "unknown link scheme"
    path_part, _, anchor = target.partition("#")
    resolved = source if not path_part else (source.parent / path_part).resolve()
    if not resolved.exists():
        return f"no file {path_part!r} (looked for {resolved})"
    if anchor:
        if resolved.suffix != ".md":
            return f"anchor #{anchor} on a file that is not markdown"
        if anchor not in anchors(resolved):
            return f"no heading with anchor #{anchor} in {rel(resolved)}"
    return None


def test_relative_links_resolve() -> None:
    problems = []
    for doc in DOCS:
        for number, target in links(doc):
            why = broken_link(doc, target)
            if why:
                problems.append(f"{rel(doc)}:{number}: broken link ({target}): {why}")
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_docs_have_links_to_check() -> None:
    """The link check sees the README's links (a parser that found none would pass vacuously)."""
    readme = [target for _, target in links(ROOT / "README.md")]
    assert any(target.startswith("docs/") for target in readme), readme
    assert any("#" in target for doc in DOCS for _, target in links(doc)), "no anchored link found anywhere"


def test_slug_rules() -> None:
    assert (
        slug("Masks: packed documents, padding, windows, softcap") == "masks-packed-documents-padding-windows-softcap"
    )
    assert slug("`accelerate launch`") == "accelerate-launch"
    assert (
        slug("Head-parallel × Mesh hybrid (mesh_cp's own extension)")
        == "head-parallel--mesh-hybrid-mesh_cps-own-extension"
    )
    assert (
        slug("2. Traffic at cluster scale, traced from the runtime")
        == "2-traffic-at-cluster-scale-traced-from-the-runtime"
    )


def test_readme_is_short() -> None:
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines < README_MAX_LINES, (
        f"README.md:{lines}: {lines} lines, the limit is under {README_MAX_LINES}; move detail into docs/"
    )


def note_sources() -> Iterator[Path]:
    yield ROOT / "README.md"
    for folder in NOTE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".md") and path.is_file() and "__pycache__" not in path.parts:
                yield path


def citations(text: str) -> Iterator[tuple[str, int]]:
    """Every Note cited in ``text``: its name (a wrapped name joined with one space) and the line it starts on."""
    for match in NOTE_CITE_WRAPPED.finditer(text):
        yield WRAP.sub(" ", match.group(1)).strip(), text.count("\n", 0, match.start()) + 1


def test_citations_are_found_when_wrapped() -> None:
    note = "Note"  # spelled apart, so that this file cites no Note itself
    text = f"a ({note} [Mesh\n    tiling] in x) and\n# see {note}\n# [Tree decoding]; {note} [LSE merge]\n"
    assert list(citations(text)) == [("Mesh tiling", 1), ("Tree decoding", 3), ("LSE merge", 4)]


def test_every_cited_note_is_defined() -> None:
    defined: dict[str, str] = {}
    cited: list[tuple[str, str]] = []
    for path in note_sources():
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for index, line in enumerate(lines):
            definition = NOTE_DEF.match(line)
            if definition and index + 1 < len(lines) and NOTE_RULE.match(lines[index + 1]):
                defined.setdefault(definition.group(1), f"{rel(path)}:{index + 1}")
        cited.extend((name, f"{rel(path)}:{line}") for name, line in citations(text))
    assert defined, "no Note definitions found: the pattern no longer matches how Notes are written"
    missing = [
        f"{where}: cites Note {'[' + name + ']'}, defined nowhere" for name, where in cited if name not in defined
    ]
    assert not missing, "undefined Notes:\n" + "\n".join(missing)
