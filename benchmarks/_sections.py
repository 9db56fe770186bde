"""Replace one marked section of benchmarks/RESULTS.md (or append it): shared by the benchmarks."""

from __future__ import annotations

from pathlib import Path


def write_marked_section(path: Path, section: str, begin: str, end: str) -> None:
    """Put `section` (which starts with `begin` and ends with `end`) in place of the text between
    those markers in `path`, or append it when the file has no such section."""
    text = path.read_text() if path.exists() else ""
    if begin in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)
