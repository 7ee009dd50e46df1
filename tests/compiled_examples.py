"""Example steps planned with ``@autoshard`` and compiled from abstract arguments, once per session.

Several sim tests read the same planned and compiled step (the collective, FLOP and memory fidelity tests,
the expert-parallel one): planning and compiling it again for each gave the same plan at the cost of one
more ILP and one more XLA compile. ``planned_example`` caches per argument set; callers only read
what it returns (the plan, the compiled executable, the verify report).
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

import autoshard
from autoshard.compiler.verify import verify_compiled
from autoshard.passes.intra_op import IntraOpOptions

# XLA:CPU compiler options for programs of which a test reads only numbers (a sharded step's loss and
# parameters against one device's) or the collectives in the optimized HLO: no LLVM optimization, and
# XLA:CPU's loop emitters for fusions instead of its MLIR fusion emitters, which halves the compile time of the
# examples' steps (gpt small on one device: 14 -> 7 s). The partitioned HLO and its collectives are the same
# (gpt small on (2, 4): every collective byte count identical); fusion is not (temp bytes +0.9%, bytes accessed
# -1.3%), so a program whose memory_analysis() or cost_analysis() a test reads (``planned_example``'s) keeps
# XLA's defaults.
FAST_COMPILE: dict[str, Any] = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


@dataclass(frozen=True)
class Planned:
    work: Any  # examples.Workload with abstract arguments
    step: Any  # the @autoshard step (``.plan`` is the plan)
    compiled: Any  # jax.stages.Compiled
    report: Any  # verify_compiled(plan, compiled)


def planned_example(model: str, mesh: tuple[int, ...], *, config: str = "small", cluster: str | None = None,
                    num_stages: int | None = None, time_limit_s: float = 60.0) -> Planned:
    """``examples.<model>``'s ``config`` workload planned on ``mesh`` (arguments as ``@autoshard``'s).

    The limit lets HiGHS prove most plans, or at least finish the LP restricted to the pairs that pay no
    reshard (gpt-small's whole LP takes longer than 60 s here; its restricted LP 1-3 s): a plan cut short
    before that is the search start after a time-bounded local search, which differs from run to run with
    the machine's load, and the fidelity tests that read these plans would test a different plan each time."""
    # one cache key per argument set, however the caller spells it (defaults given or not)
    return _planned(model, tuple(mesh), config, cluster, num_stages, float(time_limit_s))


@functools.cache
def _planned(model: str, mesh: tuple[int, ...], config: str, cluster: str | None, num_stages: int | None,
             time_limit_s: float) -> Planned:
    work = importlib.import_module(f"examples.{model}").workload(config, abstract=True)
    step = autoshard.autoshard(work.step, mesh=mesh, cluster=cluster, num_stages=num_stages,
                               options=IntraOpOptions(time_limit_s=time_limit_s))
    compiled = step.lower(*work.args).compile()
    return Planned(work, step, compiled, verify_compiled(step.plan, compiled))


@dataclass(frozen=True)
class SgdReference:
    work: Any  # examples.Workload with real arguments: copy them before a donating step (``fresh_state``)
    tx: Any  # optax.sgd(lr)
    step_fn: Any  # make_train_step(work.loss_fn, tx), unjitted
    losses: tuple[float, ...]  # per step, on one device
    params: Any  # after the steps, on one device

    def fresh_state(self) -> tuple[Any, Any]:
        """Copies of the initial parameters and their SGD state (an ``@autoshard`` step donates them)."""
        import jax

        params = jax.tree.map(lambda x: x.copy(), self.work.args[0])
        return params, self.tx.init(params)


def sgd_reference(model: str, *, config: str = "small", steps: int = 3, lr: float = 0.1) -> SgdReference:
    """``steps`` SGD steps of ``examples.<model>``'s workload on one device, run once per session for every
    test that compares a sharded run of the same steps with it."""
    return _sgd_reference(model, config, int(steps), float(lr))


@functools.cache
def _sgd_reference(model: str, config: str, steps: int, lr: float) -> SgdReference:
    import jax
    import optax

    from examples.common import make_train_step

    work = importlib.import_module(f"examples.{model}").workload(config)
    tx = optax.sgd(lr)
    step_fn = make_train_step(work.loss_fn, tx)
    reference = jax.jit(step_fn, compiler_options=FAST_COMPILE)
    params = jax.tree.map(lambda x: x.copy(), work.args[0])
    state, losses = (params, tx.init(params)), []
    for _ in range(steps):
        *state, loss = reference(*state, work.args[2])
        losses.append(float(loss))
    return SgdReference(work, tx, step_fn, tuple(losses), state[0])
