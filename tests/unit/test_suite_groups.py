"""The suite's scheduling holds: under ``--dist loadgroup`` (pyproject's addopts) a test runs with its group, so a
module's tests share one worker and its module fixtures are computed once.

pytest-xdist names a test's group by appending ``@group`` to its node id on the worker; with pytest 9.2 that
rewrite no longer took effect and every test was scheduled alone (the strategy-rule checks compiled their shared
programs on both workers: 65 CPU seconds instead of 33). Run without xdist (``-n 0``) this test has nothing to
check and says so.
"""
from __future__ import annotations

import pytest


def test_a_test_runs_with_its_xdist_group(request):
    if not hasattr(request.config, "workerinput"):
        pytest.skip("not run by a pytest-xdist worker (-n 0)")
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("this run's workers do not schedule by group (not --dist loadgroup)")
    groups = [m.args[0] for m in request.node.iter_markers("xdist_group")]
    assert groups == ["unit/test_suite_groups.py"], groups  # tests/conftest.py: one group per module
    assert request.node.nodeid.endswith("@unit/test_suite_groups.py"), (
        f"{request.node.nodeid}: pytest-xdist's group suffix did not take effect, so every test is scheduled "
        "alone (a pytest release pytest-xdist does not follow yet? see pyproject.toml's dev pin)")


def test_groups_are_handed_out_longest_first_each_kept_whole():
    from scheduling import UNKNOWN_TEST_S, longest_groups_first

    items = [("a", 1), ("b", 1), ("a", 2), ("c", 1), ("b", 2), ("new", 1), ("new", 2), ("new", 3)]
    seconds = {"a": 5.0, "b": 50.0, "c": 1.0}
    ordered = longest_groups_first(items, lambda item: item[0], seconds)
    # b (50 s), a (5 s), then the unrecorded group at UNKNOWN_TEST_S per test, then c (1 s)
    assert 3 * UNKNOWN_TEST_S > 1.0
    assert ordered == [("b", 1), ("b", 2), ("a", 1), ("a", 2), ("new", 1), ("new", 2), ("new", 3), ("c", 1)]
    assert sorted(ordered) == sorted(items)  # nothing lost, nothing repeated


def test_the_recorded_group_seconds_name_groups_of_this_suite(request):
    """The record orders the run; a group it names that the suite no longer has is a stale record (refresh it:
    ``python tests/scheduling.py JUNIT.xml``, see tests/scheduling.py)."""
    from scheduling import group_of, recorded_seconds

    recorded = recorded_seconds()
    assert recorded, "tests/group_seconds.json is missing or empty: the groups run in collection order"
    groups = {group_of(item) for item in request.session.items}
    if len(groups) < 20:
        pytest.skip("only part of the suite was collected: the record names groups this run did not collect")
    stale = sorted(set(recorded) - groups)
    assert not stale, f"tests/group_seconds.json names groups the suite does not have: {stale}"
