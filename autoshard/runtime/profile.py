"""``autoshard profile``: time the devices present and describe them as a ClusterSpec.

Measured on whatever jax runs on (simulated CPU devices here, GPUs or TPUs on
a real host), on any device count:

- the dense matmul rate per dtype on one device: square products of growing
  size (powers of two from 256; up to 8192 on a GPU or TPU, 1024 on a CPU,
  where a test must stay quick) until the rate stops rising by ``rate_growth``;
- the memory bandwidth of ``x * 2 + 1`` over an array large enough to leave
  the caches (1 GiB on an accelerator, at most a quarter of its memory; 64 MiB
  on a CPU), bytes read + written per second;
- the links: all-reduce / all-gather / reduce-scatter / all-to-all over each
  mesh axis at several sizes, fitted to the alpha-beta ring model
  (``meshes/calibrate.py``); or a named preset's links (``links``); on one
  device, with no preset named, the links are marked unmeasured in the
  ClusterSpec (placeholder numbers; a plan that crosses them says so).

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
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.meshes.calibrate import CollectiveFit, cluster_from, collective_fit
from autoshard.meshes.cluster import ClusterSpec, get_cluster, platform_preset
from autoshard.runtime.spmd import make_jax_mesh

log = logging.getLogger(__name__)

Progress = Callable[[str, float], None]  # (what is being measured, fraction done)
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


@dataclass(frozen=True)
class ProfileOptions:
    sizes_bytes: tuple[int, ...] = tuple(4 ** k * 4096 for k in range(6))  # per device, 4 KiB .. 4 MiB
    repeats: int = 5  # timed runs per measurement (the median is kept)
    matmul_sizes: tuple[int, ...] | None = None  # square matmuls timed per dtype; None: see matmul_sizes_for
    rate_growth: float = 0.05  # a matmul size whose rate beats the best so far by less than this ends the climb
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    elementwise_bytes: int | None = None  # the array of the bandwidth measurement; None: see copy_bytes_for
    links: str | None = None  # a preset whose links the ClusterSpec takes instead of timing collectives


@dataclass(frozen=True)
class MatmulRate:
    """The best rate of ``dtype`` square matmuls and the size that reached it."""

    dtype: str
    flops_per_s: float
    size: int
    sizes_timed: tuple[int, ...]

    def __str__(self) -> str:
        tried = ", ".join(map(str, self.sizes_timed))
        return f"matmul {self.dtype}: {self.flops_per_s / 1e12:.3g} TFLOP/s at {self.size}^3 (sizes timed: {tried})"


@dataclass(frozen=True)
class Profile:
    spec: ClusterSpec
    collectives: tuple[CollectiveFit, ...]
    matmuls: tuple[MatmulRate, ...]
    memory_bandwidth_bytes_per_s: float
    seconds: float

    @property
    def matmul_flops_per_s(self) -> dict[str, float]:
        """Peak FLOP/s per dtype, as the ClusterSpec keys them."""
        return dict(self.spec.peak_flops_per_s)

    def lines(self) -> list[str]:
        """The fit of every measurement, one line each, for a person to judge."""
        out = [str(m) for m in self.matmuls]
        out.append(f"memory bandwidth (elementwise): {self.memory_bandwidth_bytes_per_s / 1e9:.3g} GB/s")
        out += [str(f) for f in self.collectives]
        for scope, level in (("intra-node", self.spec.intra_node), ("inter-node", self.spec.inter_node)):
            if level.unmeasured:
                out.append(f"{scope} link: {level.name}; a plan that crosses it says so "
                           "(profile on two or more devices, or name a preset's links with --links)")
            elif not self.collectives:
                out.append(f"{scope} link: {level.name}, {level.bandwidth_bytes_per_s / 1e9:.3g} GB/s, "
                           f"{level.latency_s * 1e6:.3g} us (not timed here)")
        return out


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def matmul_sizes_for(platform: str) -> tuple[int, ...]:
    """Powers of two from 256 up to 8192 on an accelerator, 1024 on a CPU (module docstring)."""
    largest = 1024 if platform == "cpu" else 8192
    return tuple(2 ** k for k in range(8, largest.bit_length()))


def copy_bytes_for(platform: str, memory_bytes: float) -> int:
    """Bytes of the bandwidth measurement's array: 1 GiB on an accelerator (at most a quarter of its
    memory: the result needs as much again), 64 MiB on a CPU."""
    if platform == "cpu":
        return 64 * 2**20
    return int(min(2**30, memory_bytes / 4)) // 4 * 4


def matmul_rate(dtype: str, sizes: Sequence[int], repeats: int, precision: Any = None,
                rate_growth: float = 0.05) -> MatmulRate:
    """The best FLOP/s of square matmuls of ``dtype`` on one device (at ``precision``; None: XLA's default,
    which is TF32 for float32 on GPUs that have it): sizes in order until one beats the best so far by
    less than ``rate_growth``."""
    device = jax.devices()[0]
    best, best_size, timed = 0.0, 0, []
    step = jax.jit(lambda x: jnp.dot(x, x, precision=precision))
    for n in sizes:
        a = jax.device_put(jnp.ones((n, n), dtype), device)
        rate = 2.0 * n ** 3 / _timed(lambda a=a: step(a), repeats)
        timed.append(n)
        rising = rate > best * (1 + rate_growth)
        if rate > best:
            best, best_size = rate, n
        del a
        if not rising:
            break
    return MatmulRate(dtype, best, best_size, tuple(timed))


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
    preset = get_cluster(options.links) if options.links else None  # an unknown name fails before timing
    say = progress or (lambda _what, _done: None)
    start = time.perf_counter()
    processes, local = jax.process_count(), jax.local_device_count()
    platform = jax.devices()[0].platform
    memory = _device_memory_bytes(local)
    if processes > 1:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        mesh = make_jax_mesh((processes, local), ("nodes", "devices"), devices=devices)
        axes = [("nodes", True), ("devices", False)] if local > 1 else [("nodes", True)]
    else:
        mesh = make_jax_mesh((len(jax.devices()),), ("devices",))
        axes = [("devices", False)]
    axes = [(axis, crosses) for axis, crosses in axes if preset is None and mesh.shape[axis] >= 2]
    sizes = options.matmul_sizes or matmul_sizes_for(platform)
    total_steps = len(options.dtypes) + 2 + len(axes) * len(COLLECTIVE_KINDS) * len(options.sizes_bytes)
    done = 0

    def step(what: str) -> None:
        nonlocal done
        done += 1
        say(what, done / total_steps)

    matmuls = []
    for dtype in options.dtypes:
        matmuls.append(matmul_rate(dtype, sizes, options.repeats, rate_growth=options.rate_growth))
        step(f"matmul {dtype}")
    rates = {m.dtype: m.flops_per_s for m in matmuls}
    if "float32" in rates:  # float32 at XLA's default precision is the TF32 rate where there is one
        highest = matmul_rate("float32", sizes, options.repeats, jax.lax.Precision.HIGHEST, options.rate_growth)
        matmuls.append(MatmulRate("float32 (HIGHEST)", highest.flops_per_s, highest.size, highest.sizes_timed))
        rates["tfloat32"], rates["float32"] = rates["float32"], highest.flops_per_s
    step("matmul float32 at HIGHEST precision")
    bandwidth = elementwise_bandwidth(options.elementwise_bytes or copy_bytes_for(platform, memory), options.repeats)
    step("memory bandwidth")
    fits: list[CollectiveFit] = []
    for axis, crosses in axes:
        for kind in COLLECTIVE_KINDS:
            seconds = []
            for nbytes in options.sizes_bytes:
                seconds.append(time_collective(mesh, axis, kind, nbytes, options.repeats))
                step(f"{kind} over {axis}, {nbytes} B")
            fits.append(collective_fit(kind, axis, mesh.shape[axis], crosses, options.sizes_bytes, seconds))
    links = None
    if preset is not None:
        links = (replace(preset.intra_node, name=f"{preset.intra_node.name} (preset {preset.name})"),
                 replace(preset.inter_node, name=f"{preset.inter_node.name} (preset {preset.name})"))
    spec = cluster_from(name or f"profiled-{platform}-{processes}x{local}", processes, local, fits, rates,
                        bandwidth, memory, devices_per_process=local if processes > 1 else 0, links=links,
                        placeholder=platform_preset(platform))
    # what the platform's compiler computes in float32 is a fact of the platform, not a timing
    spec = replace(spec, f32_compute_dtypes=platform_preset(platform).f32_compute_dtypes)
    return Profile(spec, tuple(fits), tuple(matmuls), bandwidth, time.perf_counter() - start)


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
