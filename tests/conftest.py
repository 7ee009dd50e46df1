"""Test configuration: 8 simulated CPU devices, forced before jax is imported.

Tests that need the devices take the ``devices8`` fixture (or carry the ``sim``
marker, which is applied automatically to everything under tests/sim).
"""
from __future__ import annotations

import gc
import os
import shutil
import tempfile

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
# LLVM at -O0 for XLA:CPU's kernels: ~20% less compile time. The flag picks only LLVM's optimization of
# the emitted code, not the HLO passes: on the planned GPT tiny step the optimized HLO text,
# memory_analysis(), cost_analysis() and the loss were identical with and without it. Put the flag in
# XLA_FLAGS yourself to choose another level.
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX's persistent compilation cache, in a fresh temporary directory per test run (removed at its end): many
# tests compile the same program again from a new trace (a workload rebuilt, a plan applied again, a CLI or
# launcher child process), and XLA then loads the executable instead of compiling it. Set through the
# environment, before jax is imported, so that child processes share it. A JAX_COMPILATION_CACHE_DIR of your
# own is used as it is (and kept).
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="autoshard-tests-jax-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # cache every compile, however short
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")  # and however small

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402
from scheduling import group_of, longest_groups_first, recorded_seconds  # noqa: E402

jax.config.update("jax_enable_x64", False)

# Python's cyclic collector walks every tracked object on a full collection, and a worker's heap grows as the
# session caches fill (planned examples, compiled executables): 63 full passes took 43 CPU s of one run. The
# objects alive once the tests are collected (the imported libraries, the test modules) are frozen out of the
# collector's walks, and a full collection waits for four times as many younger ones as Python's default: on
# six of the longest modules, 10.4 -> 3.6 s of full collections. The planner pauses the collector itself while
# it plans (autoshard/compiler/collector.py); this is the tests' own code around it.
gc.set_threshold(gc.get_threshold()[0], gc.get_threshold()[1], 40)


@pytest.fixture(autouse=True)
def _no_kept_lp_bases():
    """Each test solves its LPs as a fresh process would: the simplex bases a process keeps between solves of
    one LP (``autoshard/passes/ilp/warm.py``) do not carry from one test to the next, so no test's plan depends
    on which tests its worker ran before it."""
    from autoshard.passes.ilp import warm

    warm.clear()
    yield


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.fspath).replace(os.sep, "/")
        if "tests/sim" in path:
            item.add_marker(pytest.mark.sim)
        # pytest-xdist (pyproject's addopts: one worker per core, --dist loadgroup) runs each group on one
        # worker: a module's tests stay together, so its module fixtures are computed once; tests that share
        # a session cache across modules (compiled_examples.planned_example) name a group of their own.
        if not any(item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(path.rsplit("/tests/", 1)[-1]))
    # the longest groups first (tests/scheduling.py), so that no long group is left for one worker at the end
    items[:] = longest_groups_first(items, group_of, recorded_seconds())


@pytest.fixture(scope="session")
def devices8():
    devices = jax.devices()
    if len(devices) < 8:
        pytest.fail(f"expected 8 simulated devices, got {len(devices)}: XLA_FLAGS was set too late")
    return devices[:8]
