"""Test configuration: 8 simulated CPU devices, forced before jax is imported.

Tests that need the devices take the ``devices8`` fixture (or carry the ``sim``
marker, which is applied automatically to everything under tests/sim).
"""
from __future__ import annotations

import os

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

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/sim" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.sim)


@pytest.fixture(scope="session")
def devices8():
    devices = jax.devices()
    if len(devices) < 8:
        pytest.fail(f"expected 8 simulated devices, got {len(devices)}: XLA_FLAGS was set too late")
    return devices[:8]
