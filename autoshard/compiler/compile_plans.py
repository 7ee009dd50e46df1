"""Compile SPMD plans with XLA and read what it compiled, on meshes of any size.

A plan whose mesh has no more devices than jax has here is compiled in this
process (``SpmdStep`` on the first devices). A larger mesh (16 or 32 devices of
a two- or four-node cluster, with 8 simulated CPU devices here) cannot be
compiled by this process: XLA:CPU has no compile-only topology, and the device
count of a process is fixed when jax starts. So such a plan is lowered here on
an ``AbstractMesh`` of its shape (no devices needed), exported with
``jax.export`` (StableHLO with its shardings), and compiled by a fresh Python
process started with ``--xla_force_host_platform_device_count`` = the mesh
size (``compiler/compile_worker.py``): one process per mesh size compiles every
plan of that size, and sends back what ``summarize_compiled`` read (the HLO's
collectives with their replica groups, FLOPs, bytes accessed, memory).

The child compiles the very program traced here, with the same shardings;
only donation is left out (it changes buffer reuse, not FLOPs, bytes accessed
or collectives), so its memory figures are not a device's peak.

A pipeline plan is several programs, one per stage and action, each on its own
stage's devices (``compile_pipeline``): it compiles here whenever every stage
fits in the devices present, whatever the cluster's size.
"""
from __future__ import annotations

import logging
import math
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from autoshard.compiler.hlo import CompiledSummary, summarize_compiled
from autoshard.ir.graph import OpGraph
from autoshard.runtime.applied import annotations_for
from autoshard.runtime.pipeline_lower import PipelineCompiled
from autoshard.plans.plan import Plan
from autoshard.runtime.spmd import SpmdStep, make_jax_mesh

log = logging.getLogger(__name__)

WORKER_TIMEOUT_S = 3600.0  # one child process compiling every plan of one mesh size
DEVICE_FLAG = "--xla_force_host_platform_device_count"


@dataclass(frozen=True)
class CompileJob:
    """One exported plan for the child process (plain data: it is pickled across)."""

    exported: bytes  # jax.export serialization of the planned step
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    in_entries: tuple[tuple[object, ...], ...]  # PartitionSpec entries per flat input
    out_entries: tuple[tuple[object, ...], ...]  # per flat output


@dataclass(frozen=True)
class CompiledPlan:
    """What XLA compiled for one plan, or why it could not."""

    summary: CompiledSummary | None
    error: str | None
    compile_s: float
    where: str  # "here" (this process) or "child process of N devices"


def flat_shapes(graph: OpGraph) -> list[jax.ShapeDtypeStruct]:
    """The step's flat arguments as abstract values (PRNG key dtypes included)."""
    if graph.jaxpr is not None:
        return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in graph.jaxpr.in_avals]
    return [jax.ShapeDtypeStruct(graph.values[v].shape, graph.values[v].dtype) for v in graph.inputs]


def _error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"


def compile_here(graph: OpGraph, plan: Plan) -> CompiledPlan:
    """Compile ``plan`` of ``graph`` on this process's first devices."""
    start = time.perf_counter()
    try:
        step = SpmdStep(graph, annotations_for(plan, graph), make_jax_mesh(tuple(plan.mesh_shape), plan.axis_names))
        summary = summarize_compiled(step.jitted.lower(*flat_shapes(graph)).compile())
    except Exception as err:  # noqa: BLE001 — a candidate that does not compile is reported, not fatal
        log.warning("compiling %s failed: %s", plan.name, err)
        return CompiledPlan(None, _error_text(err), time.perf_counter() - start, "here")
    return CompiledPlan(summary, None, time.perf_counter() - start, "here")


def compile_pipeline(plan: Plan, fn: Callable[..., Any], args: Sequence[Any]) -> PipelineCompiled:
    """Every stage executable of the pipeline ``plan`` of ``fn(*args)`` compiled on this process's devices.

    Each executable runs on its own stage's devices only, so a plan for more devices than are present (16 on
    two simulated nodes, with 8 here) compiles with its device indices wrapped onto the devices present
    (index i on device i mod n): an executable's HLO names its devices by their position in its stage's
    mesh, and its price reads the stage's own devices of the cluster (``verify_pipeline``), so both are as
    on the cluster. Raises ValueError when a stage needs more distinct devices than are present.
    """
    from autoshard.runtime.run import run

    present = jax.devices()
    for st in plan.stages:
        if len({i % len(present) for i in st.device_indices}) < len(st.device_indices):
            raise ValueError(f"stage {st.index} of {plan.name} runs on {len(st.device_indices)} devices "
                             f"{list(st.device_indices)}; this process has {len(present)} to compile it on")
    needed = max(i for st in plan.stages for i in st.device_indices) + 1
    return run(plan, fn, [present[i % len(present)] for i in range(needed)]).lower(*args).compile()


def export_job(graph: OpGraph, plan: Plan) -> CompileJob:
    """``plan`` lowered on an abstract mesh of its shape and exported (no devices needed)."""
    from jax.sharding import AbstractMesh, AxisType

    shape, names = tuple(plan.mesh_shape), tuple(plan.axis_names)
    mesh = AbstractMesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    ann = annotations_for(plan, graph)
    step = SpmdStep(graph, ann, mesh, donate=False)  # type: ignore[arg-type]  # an AbstractMesh lowers alike
    exported = jax.export.export(step.jitted, platforms=("cpu",))(*flat_shapes(graph))
    return CompileJob(bytes(exported.serialize()), shape, names,
                      tuple(tuple(s.partition_entries()) for s in ann.input_specs),
                      tuple(tuple(s.partition_entries()) for s in ann.output_specs))


def compile_in_child(jobs: Sequence[CompileJob], num_devices: int,
                     timeout_s: float = WORKER_TIMEOUT_S) -> list[CompiledSummary | str]:
    """Compile ``jobs`` in one child process with ``num_devices`` simulated CPU devices: per job its summary,
    or the error text."""
    with tempfile.TemporaryDirectory(prefix="autoshard-compile-") as tmp:
        jobs_path, out_path = os.path.join(tmp, "jobs.pkl"), os.path.join(tmp, "out.pkl")
        with open(jobs_path, "wb") as f:
            pickle.dump(list(jobs), f)
        env = dict(os.environ)
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_FLAG)]
        env["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_FLAG}={num_devices}"])
        env["JAX_PLATFORMS"] = "cpu"
        cmd = [sys.executable, "-m", "autoshard.compiler.compile_worker", jobs_path, out_path]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return [f"the child compile process ran over {timeout_s:g} s"] * len(jobs)
        if done.returncode != 0 or not os.path.exists(out_path):
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
            return [f"the child compile process failed (exit {done.returncode}): {tail}"] * len(jobs)
        with open(out_path, "rb") as f:
            return pickle.load(f)  # written by our own worker from our own jobs


def compile_plans(graph: OpGraph, plans: Sequence[Plan]) -> list[CompiledPlan]:
    """Compile every (SPMD) plan of ``graph``: here when jax has the devices, else in a child process per
    mesh size (module docstring). Results are in ``plans`` order; a failure is recorded, not raised."""
    results: list[CompiledPlan | None] = [None] * len(plans)
    waiting: dict[int, list[tuple[int, CompileJob, float]]] = {}
    present = len(jax.devices())
    for i, plan in enumerate(plans):
        size = math.prod(plan.mesh_shape)
        if size <= present:
            results[i] = compile_here(graph, plan)
            continue
        start = time.perf_counter()
        try:
            waiting.setdefault(size, []).append((i, export_job(graph, plan), time.perf_counter() - start))
        except Exception as err:  # noqa: BLE001 — recorded per plan
            log.warning("exporting %s failed: %s", plan.name, err)
            results[i] = CompiledPlan(None, _error_text(err), time.perf_counter() - start, "export")
    for size, jobs in waiting.items():
        start = time.perf_counter()
        out = compile_in_child([job for _, job, _ in jobs], size)
        each = (time.perf_counter() - start) / len(jobs)
        for (i, _job, export_s), got in zip(jobs, out):
            where = f"child process of {size} devices"
            results[i] = (CompiledPlan(None, got, export_s + each, where) if isinstance(got, str)
                          else CompiledPlan(got, None, export_s + each, where))
    return [r for r in results if r is not None]
