"""The child process of ``compiler/compile_plans.py``: compile exported plans on N simulated CPU devices.

    python -m autoshard.compiler.compile_worker JOBS.pkl OUT.pkl

The parent starts it with ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` and ``JAX_PLATFORMS=cpu``
(jax reads them once, at start). Each job (``CompileJob``) is deserialized with ``jax.export``, jitted with
its plan's input and output shardings on a mesh of the first devices, lowered, compiled and read by
``summarize_compiled``; OUT.pkl gets, per job, the summary or the error text. A worker whose parent is gone
(killed mid-comparison) stops at once rather than compiling for nobody (``exit_with_parent``).
"""
from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.compiler.compile_plans import CompileJob
from autoshard.compiler.hlo import CompiledSummary, summarize_compiled
from autoshard.runtime.spmd import make_jax_mesh


def compile_job(job: CompileJob) -> CompiledSummary:
    exported = jax.export.deserialize(bytearray(job.exported))
    mesh = make_jax_mesh(job.mesh_shape, job.axis_names)
    ins = tuple(NamedSharding(mesh, PartitionSpec(*e)) for e in job.in_entries)
    outs = tuple(NamedSharding(mesh, PartitionSpec(*e)) for e in job.out_entries)
    jitted = jax.jit(exported.call, in_shardings=ins, out_shardings=outs)
    return summarize_compiled(jitted.lower(*exported.in_avals).compile())


def exit_with_parent(parent_pid: int, poll_s: float = 1.0) -> threading.Thread:
    """Exit this process once its parent ``parent_pid`` is gone (the child is re-parented), checked every
    ``poll_s`` seconds on a daemon thread: a compile of 16 or 32 simulated devices takes minutes."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(3)

    thread = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    thread.start()
    return thread


def main(argv: Sequence[str]) -> int:
    jobs_path, out_path = argv
    exit_with_parent(os.getppid())
    with open(jobs_path, "rb") as f:
        jobs: list[CompileJob] = pickle.load(f)  # written by the parent, our own data
    out: list[CompiledSummary | str] = []
    for job in jobs:
        try:
            out.append(compile_job(job))
        except Exception as err:  # noqa: BLE001 — reported per job to the parent
            out.append(f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}")
    with open(out_path, "wb") as f:
        pickle.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
