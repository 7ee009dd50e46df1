"""The fuzz corpus in CI: 50 random train steps planned on (2, 4), (8,), (1, 8) and 6 devices, run, and
compared with the same step on one device (tests/fuzz/fuzz_check.py says how).

The programs are drawn by hypothesis from ``fuzz_programs.programs()`` with a fixed derandomized seed, so CI
runs the same 50 every time. To keep CI's time small each program runs on two of the four meshes, drawn
with it (every mesh gets a share; the test checks it); ``python -m tests.fuzz --n 2000`` runs a long random
corpus with every program on all four (its last counts are in benchmarks/RESULTS.md, "Fuzz corpus"). A
crash or a mismatch fails the test, and hypothesis then shrinks the program to a small one that still
fails; a ``PlanningError`` (autoshard refusing a construct by name) is allowed and counted.
"""
from __future__ import annotations

import collections
import itertools
import warnings

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_check import CLUSTERS, MESHES, check, reference
from fuzz_programs import programs

CI_PROGRAMS = 50
CI_MAX_LAYERS = 3  # compile time dominates: CI's programs stay small (the long run draws up to 4 layers)
MESH_PAIRS = list(itertools.combinations(MESHES, 2))


def test_random_programs_match_one_device(devices8):
    seen: dict[str, collections.Counter] = {}
    meshes_used: collections.Counter = collections.Counter()

    @settings(max_examples=CI_PROGRAMS, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(program=programs(CI_MAX_LAYERS), cluster=st.sampled_from(sorted(CLUSTERS)),
           meshes=st.sampled_from(MESH_PAIRS))
    def one(program, cluster, meshes):
        want = reference(program)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # unsupported-primitive and over-budget warnings are counted, not shown
            outcomes = [check(program, mesh, cluster, want=want) for mesh in meshes]
        seen[repr(program)] = seen.get(repr(program), collections.Counter()) + collections.Counter(
            o.status for o in outcomes)
        meshes_used.update(meshes)
        bad = [o for o in outcomes if o.status in ("crash", "mismatch")]
        assert not bad, "\n".join(map(str, bad))

    one()
    totals = sum(seen.values(), collections.Counter())
    assert len(seen) >= CI_PROGRAMS, f"only {len(seen)} distinct programs ran"
    assert totals["ok"] >= 0.9 * sum(totals.values()), f"too many refusals: {dict(totals)}"
    assert set(meshes_used) == set(MESHES) and min(meshes_used.values()) >= 10, dict(meshes_used)
