"""The results page stays a results page, and what points into it names what is there.

docs/BENCHMARKS.md holds current figures under headings that say what they measure; the run diary
lives in docs/notes/ (dated, indexed in docs/notes/README.md). These checks read files only.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "docs" / "BENCHMARKS.md"
NOTES = ROOT / "docs" / "notes"
MAX_BENCHMARKS_LINES = 400

SCANNED_ROOTS = ("README.md", "docs", "ds_configs", "flexrl_ds", "tests", "scripts")
SCANNED_SUFFIXES = {".md", ".py", ".sh", ".json", ".toml", ".yaml", ".yml", ".txt"}

ORDINAL = (r"(?:first|second|third|\w*(?:fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh"
           r"|twelfth|teenth|tieth)|(?:twenty|thirty|forty)-\w+|\d+(?:st|nd|rd|th))")
RUN_ORDINAL = re.compile(rf"\b{ORDINAL}[\"”']?\s+run\b", re.IGNORECASE)
"""'seventh run', 'twenty-third run', '"nineteenth" ... run' (the last word before 'run')."""
HEADING_REFERENCE = re.compile(r"BENCHMARKS\.md,?\s*\(?\"([^\"]+)\"")
"""docs/BENCHMARKS.md, "Heading" / docs/BENCHMARKS.md ("Heading") / docs/BENCHMARKS.md "Heading"."""
ANCHOR_REFERENCE = re.compile(r"BENCHMARKS\.md#([\w-]+)")
NOTES_REFERENCE = re.compile(r"docs/notes/([\w.-]+\.md)")
NOTES_HEADING_REFERENCE = re.compile(r"docs/notes/([\w.-]+\.md),?\s*\(?\"([^\"]+)\"")
"""docs/notes/FILE.md, "Heading" (a heading's first words are enough: the diary's titles are long)."""


def headings(path: Path) -> list[str]:
    """Markdown headings (ATX style, outside fenced code), their text as written."""
    found, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6} (.+?)\s*#*\s*$", line)):
            found.append(match.group(1))
    return found


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation and symbols dropped (letters,
    digits, '_', '-' and spaces kept), spaces as '-'."""
    kept = "".join(ch for ch in heading.lower() if ch.isalnum() or ch in "_- ")
    return kept.replace(" ", "-")


def flattened(text: str) -> str:
    """The text as one line: each line's indentation and comment or quote markers dropped, so a
    reference wrapped over comment or docstring lines reads as written."""
    lines = (re.sub(r"^\s*(?:#+|>+|//+|\*)?\s*", "", line) for line in text.splitlines())
    return re.sub(r"\s+", " ", " ".join(lines))


def scanned_files() -> list[Path]:
    files = []
    for name in SCANNED_ROOTS:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in SCANNED_SUFFIXES
                         and "__pycache__" not in p.parts)
    return [p for p in files if p.resolve() != Path(__file__).resolve()]  # this file's patterns name none


def test_benchmarks_is_short():
    lines = len(BENCHMARKS.read_text().splitlines())
    assert lines < MAX_BENCHMARKS_LINES, (
        f"docs/BENCHMARKS.md has {lines} lines (limit {MAX_BENCHMARKS_LINES}): move superseded figures "
        f"and run-by-run detail to a dated file in docs/notes/")


def test_benchmarks_headings_say_what_they_measure():
    by_ordinal = [h for h in headings(BENCHMARKS) if RUN_ORDINAL.search(h)]
    assert not by_ordinal, f"headings titled by run ordinal (the diary goes to docs/notes/): {by_ordinal}"


def test_readme_cites_no_run_ordinals():
    cited = RUN_ORDINAL.findall(flattened((ROOT / "README.md").read_text()))
    assert not cited, f"README.md cites runs by ordinal, link a docs/BENCHMARKS.md heading instead: {cited}"


def test_references_to_benchmarks_name_existing_headings():
    titles = {re.sub(r"\s+", " ", h) for h in headings(BENCHMARKS)}
    anchors = {github_anchor(h) for h in titles}
    broken = []
    for path in scanned_files():
        text = flattened(path.read_text(errors="replace"))
        for match in HEADING_REFERENCE.finditer(text):
            moved_from = re.search(r"\bfrom (?:docs/)?$", text[max(0, match.start() - 12):match.start()])
            if not moved_from and match.group(1).strip() not in titles:
                broken.append(f"{path.relative_to(ROOT)}: \"{match.group(1)}\"")
        broken += [f"{path.relative_to(ROOT)}: #{a}" for a in ANCHOR_REFERENCE.findall(text) if a not in anchors]
    assert not broken, "references to docs/BENCHMARKS.md headings that do not exist:\n" + "\n".join(broken)


def test_github_anchor_matches_githubs_rule():
    assert github_anchor("Update efficiency (`flexrl bench update`)") == "update-efficiency-flexrl-bench-update"
    assert github_anchor("Weight sync: CUDA IPC vs host memory") == "weight-sync-cuda-ipc-vs-host-memory"
    assert github_anchor("The README's main job") == "the-readmes-main-job"
    assert github_anchor("FlexUlysses on 2× H200") == "flexulysses-on-2-h200"


def test_notes_are_indexed_and_references_to_them_exist():
    index = (NOTES / "README.md").read_text()
    unindexed = [p.name for p in sorted(NOTES.glob("*.md")) if p.name != "README.md" and f"]({p.name})" not in index]
    assert not unindexed, f"docs/notes/README.md does not list: {unindexed}"
    missing = sorted({f"{path.relative_to(ROOT)}: docs/notes/{name}" for path in scanned_files()
                      for name in NOTES_REFERENCE.findall(path.read_text(errors="replace"))
                      if not (NOTES / name).is_file()})
    assert not missing, "references to notes that do not exist:\n" + "\n".join(missing)


def test_references_to_note_headings_exist():
    broken = []
    for path in scanned_files():
        for name, heading in NOTES_HEADING_REFERENCE.findall(flattened(path.read_text(errors="replace"))):
            note = NOTES / name
            titles = [re.sub(r"\s+", " ", h) for h in headings(note)] if note.is_file() else []
            if not any(title.startswith(heading.strip()) for title in titles):
                broken.append(f"{path.relative_to(ROOT)}: docs/notes/{name}, \"{heading}\"")
    assert not broken, "references to note headings that do not exist:\n" + "\n".join(broken)


def test_relative_markdown_links_resolve():
    """Links and images by relative path (a moved page keeps its figures: docs/notes/ needs ../figures/)."""
    broken = []
    for path in (p for p in scanned_files() if p.suffix == ".md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(errors="replace")):
            if not re.match(r"[a-z]+:", target) and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, "relative links to files that do not exist:\n" + "\n".join(broken)
