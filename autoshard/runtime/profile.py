"""``autoshard profile``: time the devices present and describe them as a ClusterSpec.

Measured on whatever jax runs on (simulated CPU devices here, GPUs or TPUs on
a real host): the best dense matmul rate per dtype on one device, the memory
bandwidth of a large elementwise op (bytes read + written per second), and
all-reduce / all-gather / reduce-scatter / all-to-all over each mesh axis at
several sizes, fitted to the alpha-beta ring model (``meshes/calibrate.py``).
The mesh is the processes by their local devices: with several processes
(``jax.distributed``), axis 0 crosses processes and prices the inter-node
link, axis 1 the intra-node one; with one process, one axis over all devices.

Each timing is the median of a few runs after a warm-up call (compiling is
not timed), ``block_until_ready`` included.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.meshes.calibrate import CollectiveFit, cluster_from, collective_fit
from autoshard.meshes.cluster import ClusterSpec
from autoshard.runtime.spmd import make_jax_mesh

log = logging.getLogger(__name__)

Progress = Callable[[str, float], None]  # (what is being measured, fraction done)
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


@dataclass(frozen=True)
class ProfileOptions:
    sizes_bytes: tuple[int, ...] = tuple(4 ** k * 4096 for k in range(6))  # per device, 4 KiB .. 4 MiB
    repeats: int = 5  # timed runs per measurement (the median is kept)
    matmul_sizes: tuple[int, ...] = (512, 1024)  # square matmuls timed per dtype
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    elementwise_bytes: int = 64 * 2**20  # the array of the bandwidth measurement


@dataclass(frozen=True)
class Profile:
    spec: ClusterSpec
    collectives: tuple[CollectiveFit, ...]
    matmul_flops_per_s: dict[str, float]
    memory_bandwidth_bytes_per_s: float
    seconds: float

    def lines(self) -> list[str]:
        """The fit of every measurement, one line each, for a person to judge."""
        out = [f"matmul {dtype}: {rate / 1e12:.3g} TFLOP/s" for dtype, rate in self.matmul_flops_per_s.items()]
        out.append(f"memory bandwidth (elementwise): {self.memory_bandwidth_bytes_per_s / 1e9:.3g} GB/s")
        out += [str(f) for f in self.collectives]
        return out


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def matmul_rate(dtype: str, sizes: Sequence[int], repeats: int, precision: Any = None) -> float:
    """The best FLOP/s of square matmuls of ``dtype`` on one device (at ``precision``; None: XLA's default,
    which is TF32 for float32 on GPUs that have it)."""
    device = jax.devices()[0]
    best = 0.0
    for n in sizes:
        a = jax.device_put(jnp.ones((n, n), dtype), device)
        step = jax.jit(lambda x: jnp.dot(x, x, precision=precision))
        best = max(best, 2.0 * n ** 3 / _timed(lambda: step(a), repeats))
    return best


def elementwise_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes per second of ``x * 2 + 1`` on one device: the array read once and written once."""
    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), jax.devices()[0])
    step = jax.jit(lambda v: v * 2.0 + 1.0)
    return 2.0 * (nbytes // 4) * 4 / _timed(lambda: step(x), repeats)


def _collective_fn(kind: str, axis: str) -> Callable[[Any], Any]:
    if kind == "all-reduce":
        return lambda x: jax.lax.psum(x, axis)
    if kind == "all-gather":
        return lambda x: jax.lax.all_gather(x, axis, tiled=True)
    if kind == "reduce-scatter":
        return lambda x: jax.lax.psum_scatter(x, axis, tiled=True)
    return lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


def time_collective(mesh: jax.sharding.Mesh, axis: str, kind: str, nbytes: int, repeats: int) -> float:
    """Seconds of one ``kind`` over ``axis`` with ``nbytes`` per device as HLO shows it (the result of an
    all-gather, the operand of a reduce-scatter, the buffer otherwise)."""
    n = mesh.shape[axis]
    local = max(n, nbytes // 4 // n * n)  # elements per device, divisible by the axis size
    if kind == "all-gather":
        local = max(1, local // n)  # each device holds 1/n of the gathered result
    others = [a for a in mesh.axis_names if a != axis]
    spec = PartitionSpec((*others, axis))
    total = local * mesh.devices.size
    x = jax.device_put(jnp.ones((total,), jnp.float32), NamedSharding(mesh, spec))
    fn = jax.jit(jax.shard_map(_collective_fn(kind, axis), mesh=mesh, in_specs=spec, out_specs=spec,
                               check_vma=False))
    return _timed(lambda: fn(x), repeats)


def profile_devices(options: ProfileOptions | None = None, progress: Progress | None = None,
                    name: str | None = None) -> Profile:
    """Measure the devices present (module docstring) and describe them as a ClusterSpec."""
    options = options or ProfileOptions()
    say = progress or (lambda _what, _done: None)
    start = time.perf_counter()
    processes, local = jax.process_count(), jax.local_device_count()
    if processes > 1:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        mesh = make_jax_mesh((processes, local), ("nodes", "devices"), devices=devices)
        axes = [("nodes", True), ("devices", False)] if local > 1 else [("nodes", True)]
    else:
        mesh = make_jax_mesh((len(jax.devices()),), ("devices",))
        axes = [("devices", False)]
    total_steps = len(options.dtypes) + 2 + len(axes) * len(COLLECTIVE_KINDS) * len(options.sizes_bytes)
    done = 0

    def step(what: str) -> None:
        nonlocal done
        done += 1
        say(what, done / total_steps)

    rates: dict[str, float] = {}
    for dtype in options.dtypes:
        rates[dtype] = matmul_rate(dtype, options.matmul_sizes, options.repeats)
        step(f"matmul {dtype}")
    if "float32" in rates:  # float32 at XLA's default precision is the TF32 rate where there is one
        rates["tfloat32"] = rates["float32"]
        rates["float32"] = matmul_rate("float32", options.matmul_sizes, options.repeats, jax.lax.Precision.HIGHEST)
    step("matmul float32 at HIGHEST precision")
    bandwidth = elementwise_bandwidth(options.elementwise_bytes, options.repeats)
    step("memory bandwidth")
    fits: list[CollectiveFit] = []
    for axis, crosses in axes:
        if mesh.shape[axis] < 2:
            continue
        for kind in COLLECTIVE_KINDS:
            seconds = []
            for nbytes in options.sizes_bytes:
                seconds.append(time_collective(mesh, axis, kind, nbytes, options.repeats))
                step(f"{kind} over {axis}, {nbytes} B")
            fits.append(collective_fit(kind, axis, mesh.shape[axis], crosses, options.sizes_bytes, seconds))
    platform = jax.devices()[0].platform
    spec = cluster_from(name or f"profiled-{platform}-{processes}x{local}", processes, local, fits, rates,
                        bandwidth, _device_memory_bytes(local), devices_per_process=local if processes > 1 else 0)
    return Profile(spec, tuple(fits), rates, bandwidth, time.perf_counter() - start)


def _device_memory_bytes(local_devices: int) -> float:
    """The memory one device may use: what the backend reports, else the host's RAM over its devices."""
    stats = jax.devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        host = 16 * 2**30
    return float(host) / max(1, local_devices)
