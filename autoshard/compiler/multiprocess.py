"""One plan for every process of a multi-process job (``runtime/distributed.py`` starts the job).

Process 0 traces and plans; the plan travels as its JSON file text through the
distributed runtime's key-value store; every process, process 0 included, runs
the plan decoded from those same bytes, and re-traces the step locally, which
``autoshard.apply`` checks against the plan's signature. Planning on every process
instead is not safe: CP-SAT is deterministic only when it is not cut by its
wall-clock time limit, which is the usual case for real models, and N
processes sharing a host would each pay the full solve. The key-value store
(not a collective) carries the plan because process 1 may wait minutes while
process 0 solves, with an explicit timeout and an error message from process 0
when planning fails there.

Batch leaves are pinned split over the process-crossing axes along their first
dimension (``shard_batch=True``), so each process feeds only its rows.

**Pipeline plans** (``num_stages`` > 1) run too: every process builds every
stage's executables and runs those whose sub-mesh devices it holds; the
activations crossing a process boundary travel by ``runtime/cross_process.py``.
Each process passes the same whole arguments (host arrays, or the previous
step's outputs: the ones another process owns come back as stand-ins for its
arrays); the batch is not split over processes (``shard_batch`` is for SPMD
plans).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import jax
from jax.sharding import Mesh

from autoshard.compiler.driver import plan_graph
from autoshard.compiler.pipeline_context import PipelineRequest
from autoshard.compiler.pipeline_driver import plan_pipeline
from autoshard.ir.graph import OpGraph, Role
from autoshard.ir.spec import Spec
from autoshard.ir.trace import trace
from autoshard.meshes.cluster import ClusterSpec
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.runtime.applied import AppliedPlan
from autoshard.runtime.applied_pipeline import AppliedPipeline
from autoshard.runtime.run import run
from autoshard.plans.plan import Plan
from autoshard.plans.planfile import plan_to_json
from autoshard.runtime.distributed import MultiProcessError, axes_crossing_processes, multiprocess_cluster

PLAN_KEY_PREFIX = "autoshard/plan/"
_ERROR_MARK = b"autoshard-error:"


def check_runs_multiprocess(plan: Plan) -> None:
    """Raise MultiProcessError for a plan the multi-process runtime cannot run (a staged plan that does not
    record its layers' equations: written by hand or by an older autoshard)."""
    staged = plan.stages or plan.num_microbatches > 1 or plan.schedule not in ("spmd", "")
    if staged and (plan.pipeline is None or not plan.pipeline.layer_eqns):
        raise MultiProcessError(
            f"plan '{plan.name}' is a pipeline plan ({len(plan.stages)} stages, {plan.num_microbatches} microbatches, "
            f"schedule {plan.schedule!r}) without the layer equations the pipeline runtime needs; plan it again "
            "with plan_multiprocess(..., num_stages=N), or with num_stages=1 (one SPMD stage over the whole mesh).")


def _pinned_batch_specs(graph: OpGraph, mesh: Mesh) -> dict[int, Spec]:
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
                      timeout_s: float = 3600.0, num_stages: int = 1, num_microbatches: int | None = None,
                      schedule: str = "1f1b") -> Plan:
    """Plan ``fn(*args)`` on process 0 and give every process the same Plan (see the module docstring).

    ``args`` may be ``jax.ShapeDtypeStruct``s; ``cluster`` defaults to
    ``multiprocess_cluster()``. Every process must call this in the same order. ``num_stages`` > 1 plans a
    pipeline over the mesh's devices (in ``mesh.devices.flat`` order) with ``num_microbatches`` (None:
    searched) and ``schedule``.
    """
    cluster = multiprocess_cluster() if cluster is None else cluster
    multi = jax.process_count() > 1
    key = f"{PLAN_KEY_PREFIX}{next(_plan_calls)}"
    if jax.process_index() == 0:
        try:
            if num_stages > 1:
                plan = plan_pipeline(fn, args, PipelineRequest(
                    cluster=cluster, memory_budget=memory_budget, num_stages=num_stages,
                    num_microbatches=num_microbatches, schedule=schedule, options=options,
                    num_devices=mesh.devices.size)).plan
            else:
                graph = trace(fn, *args)
                opts = options or IntraOpOptions()
                if shard_batch:
                    opts = replace(opts, pinned_inputs={**_pinned_batch_specs(graph, mesh), **opts.pinned_inputs})
                plan = plan_graph(graph, mesh=mesh, cluster=cluster, memory_budget=memory_budget, options=opts,
                                  name=getattr(fn, "__name__", "autoshard")).plan
            check_runs_multiprocess(plan)
            payload = json.dumps(plan_to_json(plan)).encode()
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
    plan = Plan.from_json(json.loads(payload), source=f"plan from process 0 ({key})")
    check_runs_multiprocess(plan)
    return plan


def plan_digest(plan: Plan) -> str:
    """SHA-256 of the plan's file text without its clock fields: equal digests, equal plans."""
    data = plan_to_json(plan)
    for volatile in ("created", "planning_s"):  # when it was written, how long planning took
        data.pop(volatile, None)
    data.get("solver", {}).pop("solve_s", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def apply_plan(plan: Plan, fn: Callable[..., Any], mesh: Mesh, args: Sequence[Any]) -> Any:
    """``autoshard.apply(plan, fn, mesh)``, traced from the shapes of ``args`` (arrays or ShapeDtypeStructs).

    Tracing from plain shapes matters: traced with committed, sharded arrays,
    jax inserts ``reshard`` equations for constants (4 in the GPT example), and
    the trace no longer matches the plan's operation count.
    """
    check_runs_multiprocess(plan)
    applied: AppliedPlan | AppliedPipeline = run(plan, fn, mesh)
    applied.prepare(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tuple(args)))
    return applied
