"""The order in which pytest-xdist hands out the suite's groups: the longest first.

Under ``--dist loadgroup`` a worker takes one group (a module, or a named ``xdist_group``) at a time, and the run
ends when the last group does. pytest-xdist orders groups by their number of tests, so the suite's longest
groups (one or two end-to-end tests each: the README commands, the fuzz corpus, the launcher) came last and one
worker ran them alone while the other had finished (651 against 596 s of test time on the two workers of one run;
623 each, ordered by time). So the groups are ordered here by the seconds they took in a recorded run
(``group_seconds.json`` beside this file), longest first, and pyproject's addopts turn xdist's own reordering off.
A group the record lacks (a new module) is estimated at ``UNKNOWN_TEST_S`` per test. The record only orders: a
stale one costs balance, never a test.

Refresh the record from a run's JUnit report::

    python -m pytest -q --junitxml=junit.xml
    python tests/scheduling.py junit.xml
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

RECORD = Path(__file__).with_name("group_seconds.json")
UNKNOWN_TEST_S = 0.5  # seconds per test of a group the record lacks

T = TypeVar("T")


def recorded_seconds(path: Path = RECORD) -> dict[str, float]:
    """Seconds per group from the record; empty when there is none."""
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}


def longest_groups_first(items: Sequence[T], group_of: Callable[[T], str], seconds: Mapping[str, float]) -> list[T]:
    """``items`` with each group's tests together, in their order, and the groups by their recorded seconds,
    longest first (ties, and groups estimated alike, in the order they were collected)."""
    groups: dict[str, list[T]] = {}
    for item in items:
        groups.setdefault(group_of(item), []).append(item)

    def weight(group: str) -> float:
        return seconds.get(group, UNKNOWN_TEST_S * len(groups[group]))

    order = sorted(groups, key=lambda g: -weight(g))  # sorted is stable: ties keep collection order
    return [item for group in order for item in groups[group]]


def group_of(item) -> str:
    """A collected test's xdist group (tests/conftest.py gives every test one)."""
    return next(item.iter_markers("xdist_group")).args[0]


def seconds_from_junit(path: Path) -> dict[str, float]:
    """Seconds per group from a JUnit report of an xdist run (each test's name ends in ``@group``)."""
    seconds: dict[str, float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        if "@" not in name:
            continue
        group = name.rsplit("@", 1)[1]
        seconds[group] = seconds.get(group, 0.0) + float(case.get("time", 0.0))
    return seconds


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    seconds = seconds_from_junit(Path(argv[0]))
    if not seconds:
        print(f"{argv[0]}: no test names with an @group suffix (was the run under pytest-xdist?)", file=sys.stderr)
        return 1
    ordered = dict(sorted(((g, round(s, 1)) for g, s in seconds.items()), key=lambda kv: -kv[1]))
    RECORD.write_text(json.dumps(ordered, indent=1) + "\n")
    print(f"{RECORD}: {len(ordered)} groups, {sum(ordered.values()):.0f} s of tests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
