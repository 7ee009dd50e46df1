"""Sections of RESULTS.md that other runners write, kept when ``python -m benchmarks.run`` rewrites the file.

``python -m tests.fuzz --results benchmarks/RESULTS.md`` writes the "## Fuzz corpus" section from its own
run; ``benchmarks.run`` regenerates everything else and carries such sections over unchanged.
"""
from __future__ import annotations

import re

KEPT = ("## Fuzz corpus",)  # headings of sections another runner owns


def section(text: str, heading: str) -> str | None:
    """The section under ``heading`` (a ``## `` line) up to the next ``## `` heading, or None."""
    match = re.search(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", text, flags=re.S | re.M)
    return match.group(0).rstrip() + "\n" if match else None


def replace_section(text: str, heading: str, body: str) -> str:
    """``text`` with the section under ``heading`` replaced by ``body`` (a section with its heading), or
    with ``body`` appended when there is none."""
    old = section(text, heading)
    if old is None:
        return text.rstrip() + "\n\n" + body.rstrip() + "\n"
    return text.replace(old, body.rstrip() + "\n")


def carry_over(old_text: str, new_text: str) -> str:
    """``new_text`` with every KEPT section of ``old_text`` put back."""
    for heading in KEPT:
        kept = section(old_text, heading)
        if kept is not None:
            new_text = replace_section(new_text, heading, kept)
    return new_text
