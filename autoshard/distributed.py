"""Multi-host training, one import: start-up, process meshes, one plan for all processes, sharded inputs.

Gathers ``runtime/distributed.py`` (jax.distributed start-up, meshes ordered by
process, sharded state and batches) and ``compiler/multiprocess.py`` (plan on
process 0, ship the plan to every process, apply it). See docs/MULTIHOST.md.
"""
from autoshard.compiler.multiprocess import (
    PLAN_KEY_PREFIX, apply_plan, check_runs_multiprocess, plan_digest, plan_multiprocess,
)
from autoshard.runtime.distributed import (
    DistributedEnv, MultiProcessError, axes_crossing_processes, detect, global_batch, init_sharded,
    initialize_from_env, input_shardings, local_indices, multiprocess_cluster, physical_mesh, process_mesh,
    process_ordered_devices, split_over_processes, to_host,
)

__all__ = [
    "PLAN_KEY_PREFIX", "DistributedEnv", "MultiProcessError", "apply_plan", "axes_crossing_processes",
    "check_runs_multiprocess", "detect", "global_batch", "init_sharded", "initialize_from_env",
    "input_shardings", "local_indices", "multiprocess_cluster", "physical_mesh", "plan_digest", "plan_multiprocess",
    "process_mesh", "process_ordered_devices", "split_over_processes", "to_host",
]
