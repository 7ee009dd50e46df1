"""The simulated CPU devices a benchmark runs on: set before jax is imported (this module does not import it)."""
from __future__ import annotations

import os

DEVICE_FLAG = "--xla_force_host_platform_device_count"


def simulate_devices(count: int) -> None:
    """Ask XLA for ``count`` CPU devices, unless ``XLA_FLAGS`` already names a count (the caller's wins)."""
    if DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {DEVICE_FLAG}={count}").strip()
