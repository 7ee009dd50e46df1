"""Multi-process runs on JAX's own distributed runtime: start-up, one plan for all, sharded inputs.

Every process of a job runs the same program::

    env = initialize_from_env()                       # before anything touches a jax backend
    mesh = process_mesh((2, 4))                       # axis 0 crosses the processes
    plan = plan_multiprocess(step, abstract_args, mesh=mesh)   # planned on process 0, sent to all
    run = plan.apply(step, mesh)
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

**One plan for all.** Process 0 traces and plans; the plan travels as its
JSON file text through the distributed runtime's key-value store; every
process, process 0 included, runs the plan decoded from those same bytes, and
re-traces the step locally, which ``plan.apply`` checks against the plan's
signature. Planning on every process instead is not safe: CP-SAT is
deterministic only when it is not cut by its wall-clock time limit, which is
the usual case for real models, and N processes sharing a host would each pay
the full solve. The key-value store (not a collective) carries the plan because
process 1 may wait minutes while process 0 solves, with an explicit timeout and
an error message from process 0 when planning fails there.

**Cluster.** ``multiprocess_cluster`` describes N processes of K devices as N
nodes of K devices, so the inter-node (slow) link is the process boundary and
the planner prices an axis that crosses processes at that link.
``process_mesh`` orders devices by process, so mesh axis 0 is the one that
crosses processes ((2, 4) on 2 processes of 4).

**Inputs.** Batch leaves are stored split over the process-crossing axes along
their first dimension (pinned before planning, ``shard_batch=True``), so each
process feeds only its rows: ``local_indices`` says which, ``global_batch``
assembles the global arrays with ``jax.make_array_from_process_local_data``.
State is created with ``init_sharded``: the initializer is jitted with the
plan's shardings as ``out_shardings``, so no process materializes a full array.

**Pipeline plans** are refused here (``MultiProcessError``): there is no
pipeline runtime yet, let alone one whose stages map to hosts.
"""
from __future__ import annotations

import hashlib
import itertools
import json
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

from autoshard.compiler.driver import plan_graph
from autoshard.compiler.graph import Role
from autoshard.compiler.plan import Plan
from autoshard.compiler.planfile import plan_from_json, plan_to_json
from autoshard.compiler.spec import Spec
from autoshard.compiler.trace import trace
from autoshard.errors import PlanMismatchError, PlanningError
from autoshard.meshes.cluster import ClusterSpec, get_cluster
from autoshard.passes.emit import make_jax_mesh, named_sharding
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.runtime.launch import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

log = logging.getLogger(__name__)

Source = Literal["autoshard", "jax", "scheduler", "single", "initialized"]
PLAN_KEY_PREFIX = "autoshard/plan/"
_ERROR_MARK = b"autoshard-error:"


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


def axes_crossing_processes(mesh: Mesh) -> tuple[str, ...]:
    """Mesh axes along which devices of different processes meet (the slow ones)."""
    procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
    out = []
    for i, name in enumerate(mesh.axis_names):
        rows = np.moveaxis(procs, i, -1).reshape(-1, procs.shape[i])
        if (rows != rows[:, :1]).any():
            out.append(name)
    return tuple(out)


# ---- one plan for every process --------------------------------------------------------


def check_runs_multiprocess(plan: Plan) -> None:
    """Raise MultiProcessError for a plan the multi-process runtime cannot run (pipeline plans)."""
    if plan.stages or plan.num_microbatches > 1 or plan.schedule not in ("spmd", ""):
        raise MultiProcessError(
            f"plan '{plan.name}' is a pipeline plan ({len(plan.stages)} stages, {plan.num_microbatches} microbatches, "
            f"schedule {plan.schedule!r}); pipeline plans do not run across processes yet (there is no pipeline "
            "runtime). Plan with num_stages=1 (one SPMD stage over the whole mesh) for a multi-process job.")


def _pinned_batch_specs(graph: Any, mesh: Mesh) -> dict[int, Spec]:
    """Batch leaves split along dim 0 over the axes that cross processes, where those divide dim 0."""
    axes = axes_crossing_processes(mesh)
    if not axes:
        return {}
    ways = math.prod(mesh.shape[a] for a in axes)
    pinned: dict[int, Spec] = {}
    for i, vid in enumerate(graph.inputs):
        value = graph.values[vid]
        if value.role is Role.BATCH and value.rank >= 1 and value.shape[0] % ways == 0:
            pinned[i] = Spec((tuple(axes),) + ((),) * (value.rank - 1))
    return pinned


# Plans are exchanged under keys numbered by call: every process calls plan_multiprocess in the same
# order (as with any collective), so the n-th call on each process reads the n-th plan.
_plan_calls = itertools.count()


def _kv_client() -> Any:
    from jax._src.distributed import global_state  # the runtime's client; no public handle in jax 0.10

    if global_state.client is None:
        raise MultiProcessError("jax.distributed is not initialized: call initialize_from_env() first")
    return global_state.client


def plan_multiprocess(fn: Callable[..., Any], args: Sequence[Any], *, mesh: Mesh,
                      cluster: ClusterSpec | str | None = None, memory_budget: float | None = None,
                      options: IntraOpOptions | None = None, shard_batch: bool = True,
                      timeout_s: float = 3600.0) -> Plan:
    """Plan ``fn(*args)`` on process 0 and give every process the same Plan (see the module docstring).

    ``args`` may be ``jax.ShapeDtypeStruct``s; ``cluster`` defaults to
    ``multiprocess_cluster()``. Every process must call this in the same order.
    """
    cluster = multiprocess_cluster() if cluster is None else cluster
    multi = jax.process_count() > 1
    key = f"{PLAN_KEY_PREFIX}{next(_plan_calls)}"
    if jax.process_index() == 0:
        try:
            graph = trace(fn, *args)
            opts = options or IntraOpOptions()
            if shard_batch:
                opts = replace(opts, pinned_inputs={**_pinned_batch_specs(graph, mesh), **opts.pinned_inputs})
            planned = plan_graph(graph, mesh=mesh, cluster=cluster, memory_budget=memory_budget, options=opts,
                                 name=getattr(fn, "__name__", "autoshard"))
            check_runs_multiprocess(planned.plan)
            payload = json.dumps(plan_to_json(planned.plan)).encode()
        except Exception as err:
            if multi:
                _kv_client().key_value_set_bytes(key, _ERROR_MARK + f"{type(err).__name__}: {err}".encode())
            raise
        if multi:
            _kv_client().key_value_set_bytes(key, payload)
    else:
        try:
            payload = _kv_client().blocking_key_value_get_bytes(key, int(timeout_s * 1000))
        except Exception as err:  # the runtime raises its own status errors
            raise MultiProcessError(f"process {jax.process_index()} got no plan from process 0 within {timeout_s:g} s "
                                    f"({type(err).__name__}: {err}); raise timeout_s if planning is that slow") from err
        if payload.startswith(_ERROR_MARK):
            raise MultiProcessError("process 0 failed to plan: " + payload[len(_ERROR_MARK):].decode())
    plan = plan_from_json(json.loads(payload), source=f"plan from process 0 ({key})")
    check_runs_multiprocess(plan)
    return plan


def plan_digest(plan: Plan) -> str:
    """SHA-256 of the plan's file text without its clock fields: equal digests, equal plans."""
    data = plan_to_json(plan)
    for volatile in ("created", "planning_s"):  # when it was written, how long planning took
        data.pop(volatile, None)
    data.get("solver", {}).pop("solve_s", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


# ---- shardings, state, batches ------------------------------------------------------------


def input_shardings(plan: Plan, args: Sequence[Any], mesh: Mesh) -> tuple[Any, ...]:
    """The plan's NamedSharding for every leaf of ``args``, as a tuple of pytrees shaped like ``args``."""
    with_path, tree = jax.tree_util.tree_flatten_with_path(tuple(args))
    out = []
    for path, _leaf in with_path:
        name = jax.tree_util.keystr(path)
        if name not in plan.input_specs:
            raise PlanMismatchError(f"argument {name} has no spec in plan '{plan.name}': the step's arguments changed")
        out.append(named_sharding(plan.input_specs[name], mesh))
    return tuple(jax.tree_util.tree_unflatten(tree, out))


def apply_plan(plan: Plan, fn: Callable[..., Any], mesh: Mesh, args: Sequence[Any]) -> Any:
    """``plan.apply(fn, mesh)``, traced from the shapes of ``args`` (arrays or ShapeDtypeStructs).

    Tracing from plain shapes matters: traced with committed, sharded arrays,
    jax inserts ``reshard`` equations for constants (4 in the GPT example), and
    the trace no longer matches the plan's operation count.
    """
    from autoshard.runtime.applied import AppliedPlan

    check_runs_multiprocess(plan)
    applied: AppliedPlan = plan.apply(fn, mesh)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tuple(args))
    applied._build(shapes)  # noqa: SLF001 — the same package; caches the SpmdStep built from shapes
    return applied


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
