"""Multi-process runs on JAX's own distributed runtime: start-up, process meshes, sharded inputs.

Every process of a job runs the same program (``autoshard.distributed`` gathers the whole API)::

    env = initialize_from_env()                       # before anything touches a jax backend
    mesh = process_mesh((2, 4))                       # axis 0 crosses the processes
    plan = plan_multiprocess(step, abstract_args, mesh=mesh)   # compiler/multiprocess.py
    run = apply_plan(plan, step, mesh, abstract_args)
    state = init_sharded(init_fn, input_shardings(plan, abstract_args, mesh)[:2])
    batch = global_batch(local_rows, batch_shardings, global_shapes)

**Start-up.** ``initialize_from_env`` reads, in order: the launcher's
``AUTOSHARD_COORDINATOR`` / ``AUTOSHARD_NUM_PROCESSES`` / ``AUTOSHARD_PROCESS_ID``
(``autoshard launch``); jax's own ``JAX_COORDINATOR_ADDRESS`` /
``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``; else, when a scheduler is detected
(SLURM with more than one task, Open MPI, a multi-host TPU slice, Kubernetes),
it calls ``jax.distributed.initialize()`` without arguments and lets jax's
cluster detection fill them in; else the run stays single-process. On CPU
(``JAX_PLATFORMS=cpu``) collectives go through gloo.

**Cluster.** ``multiprocess_cluster`` describes N processes of K devices as N
nodes of K devices, so the inter-node (slow) link is the process boundary and
the planner prices an axis that crosses processes at that link.
``process_mesh`` orders devices by process, so mesh axis 0 is the one that
crosses processes ((2, 4) on 2 processes of 4).

**Inputs.** Batch leaves are stored split over the process-crossing axes along
their first dimension (pinned before planning), so each process feeds only its
rows: ``local_indices`` says which, ``global_batch`` assembles the global
arrays with ``jax.make_array_from_process_local_data``. State is created with
``init_sharded``: the initializer is jitted with the plan's shardings as
``out_shardings``, so no process materializes a full array.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from autoshard.errors import PlanMismatchError, PlanningError
from autoshard.meshes.cluster import ClusterSpec, get_cluster
from autoshard.runtime.launch import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from autoshard.runtime.spmd import make_jax_mesh, named_sharding

log = logging.getLogger(__name__)

Source = Literal["autoshard", "jax", "scheduler", "single", "initialized"]


class MultiProcessError(PlanningError):
    """A plan or setting that cannot run across processes; the message says what to change."""


@dataclass(frozen=True)
class DistributedEnv:
    """How this process joined (or did not join) a multi-process job."""

    num_processes: int  # -1: left to jax's cluster detection
    process_id: int  # -1: left to jax's cluster detection
    coordinator_address: str | None
    source: Source


def _int_var(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={environ[name]!r} must be an integer") from None


def _scheduler_present(environ: Mapping[str, str]) -> bool:
    slurm = all(k in environ for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                                       "SLURM_LOCALID"))
    if slurm and int(environ.get("SLURM_NTASKS", "1") or 1) > 1:
        return True
    if "OMPI_MCA_orte_hnp_uri" in environ and int(environ.get("OMPI_COMM_WORLD_SIZE", "2") or 2) > 1:
        return True
    hosts = environ.get("TPU_WORKER_HOSTNAMES") or environ.get("TPU_PROCESS_ADDRESSES") or ""
    return len([h for h in hosts.split(",") if h]) > 1


def detect(environ: Mapping[str, str] | None = None) -> DistributedEnv:
    """Read the job's shape from the environment (see the module docstring for the order)."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_COORDINATOR):
        missing = [k for k in (ENV_NUM_PROCESSES, ENV_PROCESS_ID) if k not in environ]
        if missing:
            raise ValueError(f"{ENV_COORDINATOR} is set but {missing} are not: start the job with autoshard launch "
                             "or set all three")
        return DistributedEnv(_int_var(environ, ENV_NUM_PROCESSES), _int_var(environ, ENV_PROCESS_ID),
                              environ[ENV_COORDINATOR], "autoshard")
    if environ.get("JAX_COORDINATOR_ADDRESS") and "JAX_NUM_PROCESSES" in environ and "JAX_PROCESS_ID" in environ:
        return DistributedEnv(_int_var(environ, "JAX_NUM_PROCESSES"), _int_var(environ, "JAX_PROCESS_ID"),
                              environ["JAX_COORDINATOR_ADDRESS"], "jax")
    if _scheduler_present(environ):
        return DistributedEnv(-1, -1, environ.get("JAX_COORDINATOR_ADDRESS"), "scheduler")
    return DistributedEnv(1, 0, None, "single")


def _cpu_requested(environ: Mapping[str, str]) -> bool:
    platforms = environ.get("JAX_PLATFORMS", "") or environ.get("JAX_PLATFORM_NAME", "")
    return platforms.split(",")[0].strip().lower() == "cpu"


def _exit_at_once_on_uncaught_exception() -> None:
    """After the traceback, end the process with code 1 instead of running exit handlers.

    jax's exit handler waits at a shutdown barrier for every peer (up to
    ``shutdown_timeout_seconds``, 300 s): a process that failed would look
    alive to the launcher or scheduler while its peers wait for it forever.
    """
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        previous(kind, value, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    sys.excepthook = hook


def initialize_from_env(environ: Mapping[str, str] | None = None, *, timeout_s: int = 300,
                        exit_on_error: bool = True) -> DistributedEnv:
    """Join the job this process belongs to; call before anything touches a jax backend.

    Idempotent: a second call returns the running job's shape. With no job in
    the environment the process stays single-process and nothing is initialized.
    With ``exit_on_error`` an uncaught exception ends a joined process at once
    with exit code 1 (see ``_exit_at_once_on_uncaught_exception``), so that the
    launcher or scheduler sees the failure and stops the job.
    """
    environ = os.environ if environ is None else environ
    if jax.distributed.is_initialized():
        return DistributedEnv(jax.process_count(), jax.process_index(), None, "initialized")
    env = detect(environ)
    if env.source == "single":
        return env
    if env.source != "scheduler" and env.num_processes == 1:
        return DistributedEnv(1, 0, env.coordinator_address, "single")
    if _cpu_requested(environ):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    start = time.perf_counter()
    if env.source == "scheduler":
        jax.distributed.initialize(initialization_timeout=timeout_s)
    else:
        jax.distributed.initialize(coordinator_address=env.coordinator_address, num_processes=env.num_processes,
                                   process_id=env.process_id, initialization_timeout=timeout_s)
    if exit_on_error:
        _exit_at_once_on_uncaught_exception()
    joined = DistributedEnv(jax.process_count(), jax.process_index(), env.coordinator_address, env.source)
    log.info("joined a %d-process job as process %d (%s) in %.2fs", joined.num_processes, joined.process_id,
             env.source, time.perf_counter() - start)
    return joined


# ---- cluster and mesh --------------------------------------------------------------------


def multiprocess_cluster(base: ClusterSpec | str = "cpu-8", *, num_processes: int | None = None,
                         devices_per_process: int | None = None) -> ClusterSpec:
    """``base``'s hardware as N nodes of K devices: the inter-node link is the process boundary."""
    spec = get_cluster(base)
    n = num_processes or jax.process_count()
    k = devices_per_process or jax.local_device_count()
    resized = spec.with_devices(n, k)
    return replace(resized, name=f"{spec.name}[{n} processes x {k}]", devices_per_process=k)


def process_ordered_devices() -> list[jax.Device]:
    """All devices, process by process (local ids ascending inside a process)."""
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def process_mesh(shape: Sequence[int], axis_names: Sequence[str] | None = None) -> Mesh:
    """An Auto-axis mesh whose devices are ordered by process, so the leading axes cross processes."""
    shape = tuple(int(s) for s in shape)
    names = tuple(axis_names) if axis_names is not None else ("x", "y", "z", "w")[: len(shape)]
    devices = process_ordered_devices()
    size = math.prod(shape)
    if size != len(devices):
        raise ValueError(f"mesh {shape} has {size} devices; this job has {len(devices)} "
                         f"({jax.process_count()} processes x {jax.local_device_count()}): use all of them")
    return make_jax_mesh(shape, names, devices=devices)


def split_over_processes(shape: Sequence[int], processes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(per-axis process counts, per-axis devices inside a process) of a mesh spread over ``processes``.

    The leading axes take the processes first (as ``process_mesh`` orders them), so ``(2, 4)`` on 2
    processes is ``((2, 1), (1, 4))``.
    """
    left, across = processes, []
    for size in shape:
        here = math.gcd(int(size), left)
        across.append(here)
        left //= here
    if left != 1:
        raise ValueError(f"mesh {tuple(shape)} cannot be spread over {processes} processes: its axis sizes do not "
                         f"take them (each process must own whole rows of the leading axes)")
    return tuple(across), tuple(int(s) // a for s, a in zip(shape, across))


def physical_mesh(shape: Sequence[int], axis_names: Sequence[str]) -> Mesh:
    """An Auto-axis mesh over every device of the job in the order ``jax.experimental.mesh_utils`` gives.

    ``mesh_utils`` knows the physical topology (TPU torus coordinates, GPU and host order); with several
    processes each process is a granule (``create_hybrid_device_mesh``): the leading axes cross processes,
    the others stay inside one, as ``split_over_processes`` says.
    """
    from jax.experimental import mesh_utils

    shape = tuple(int(s) for s in shape)
    if math.prod(shape) != jax.device_count():
        raise ValueError(f"mesh {shape} has {math.prod(shape)} devices; this job has {jax.device_count()} "
                         f"({jax.process_count()} processes x {jax.local_device_count()}): run the plan on as many")
    if jax.process_count() > 1:
        across, inside = split_over_processes(shape, jax.process_count())
        grid = mesh_utils.create_hybrid_device_mesh(inside, across, devices=jax.devices(), process_is_granule=True)
    else:
        grid = mesh_utils.create_device_mesh(shape, devices=jax.devices())
    return make_jax_mesh(shape, tuple(axis_names), devices=list(grid.flat))


def axes_crossing_processes(mesh: Mesh) -> tuple[str, ...]:
    """Mesh axes along which devices of different processes meet (the slow ones)."""
    procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
    out = []
    for i, name in enumerate(mesh.axis_names):
        rows = np.moveaxis(procs, i, -1).reshape(-1, procs.shape[i])
        if (rows != rows[:, :1]).any():
            out.append(name)
    return tuple(out)


# ---- shardings, state, batches ------------------------------------------------------------


def input_shardings(plan: Any, args: Sequence[Any], mesh: Mesh) -> tuple[Any, ...]:
    """The plan's NamedSharding for every leaf of ``args``, as a tuple of pytrees shaped like ``args``."""
    with_path, tree = jax.tree_util.tree_flatten_with_path(tuple(args))
    out = []
    for path, _leaf in with_path:
        name = jax.tree_util.keystr(path)
        if name not in plan.input_specs:
            raise PlanMismatchError(f"argument {name} has no spec in plan '{plan.name}': the step's arguments changed")
        out.append(named_sharding(plan.input_specs[name], mesh))
    return tuple(jax.tree_util.tree_unflatten(tree, out))


def init_sharded(init_fn: Callable[..., Any], out_shardings: Any, *args: Any,
                 compiler_options: Mapping[str, Any] | None = None) -> Any:
    """``init_fn(*args)`` created directly in ``out_shardings``: each process builds only its shards."""
    return jax.jit(init_fn, out_shardings=out_shardings, compiler_options=compiler_options)(*args)


def local_indices(sharding: NamedSharding, global_shape: Sequence[int]) -> tuple[slice, ...]:
    """The block of the global array that this process's devices hold: the rows it must load."""
    starts = [None] * len(global_shape)
    stops = [None] * len(global_shape)
    for index in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        for d, s in enumerate(index):
            lo, hi, _ = s.indices(global_shape[d])
            starts[d] = lo if starts[d] is None else min(starts[d], lo)
            stops[d] = hi if stops[d] is None else max(stops[d], hi)
    return tuple(slice(lo, hi) for lo, hi in zip(starts, stops))


def global_batch(local_batch: Any, shardings: Any, global_shapes: Any) -> Any:
    """Global arrays from each process's block (``local_indices``) of every batch leaf."""
    def one(local: Any, sharding: NamedSharding, shape: Any) -> jax.Array:
        return jax.make_array_from_process_local_data(sharding, np.asarray(local), tuple(getattr(shape, "shape", shape)))

    return jax.tree.map(one, local_batch, shardings, global_shapes)


def to_host(tree: Any) -> Any:
    """Full numpy copies of (possibly multi-process) arrays on every process, for checks and checkpoints."""
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    return multihost_utils.process_allgather(tree, tiled=True)
