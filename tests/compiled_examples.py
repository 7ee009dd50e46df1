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


@dataclass(frozen=True)
class Planned:
    work: Any  # examples.Workload with abstract arguments
    step: Any  # the @autoshard step (``.plan`` is the plan)
    compiled: Any  # jax.stages.Compiled
    report: Any  # verify_compiled(plan, compiled)


def planned_example(model: str, mesh: tuple[int, ...], *, config: str = "small", cluster: str | None = None,
                    num_stages: int | None = None, time_limit_s: float = 1.0) -> Planned:
    """``examples.<model>``'s ``config`` workload planned on ``mesh`` (arguments as ``@autoshard``'s)."""
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
    reference = jax.jit(step_fn)
    params = jax.tree.map(lambda x: x.copy(), work.args[0])
    state, losses = (params, tx.init(params)), []
    for _ in range(steps):
        *state, loss = reference(*state, work.args[2])
        losses.append(float(loss))
    return SgdReference(work, tx, step_fn, tuple(losses), state[0])
