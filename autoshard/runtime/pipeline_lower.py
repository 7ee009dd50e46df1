"""``.lower()`` of a pipelined step: every stage executable, lowered, listed, and compiled on demand.

A pipeline is not one XLA program: stage s has a forward, a backward and
(when it owns step outputs) an apply-update executable, each jitted on the
stage's own sub-mesh (``runtime/pipeline.py``). :func:`lower_pipeline` lowers
each at the shapes the runtime feeds it (one microbatch), giving a
:class:`PipelineLowered` that lists them (``str()``: one line each) and whose
``compile()`` gives a :class:`PipelineCompiled`: each executable compiled, with
its optimized HLO, ``memory_analysis()`` and ``cost_analysis()`` for
``compiler/verify_pipeline.py``.

Inputs are given as ``ShapeDtypeStruct``s: an executable jitted with input
shardings lays them out itself. A backward that applies its forward's
``jax.vjp`` pullback (the default, residuals kept) takes the residuals in the
layouts the compiled forward gives them, so lowering it compiles that forward
first (kept, not compiled twice); the apply-update executables take their
inputs on the stage's mesh as the runtime puts them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from autoshard.runtime.pipeline import PipelineStep
from autoshard.runtime.stage_layout import replicated


@dataclass(frozen=True, eq=False)
class StageExecutable:
    """One lowered stage program."""

    stage: int
    action: str  # "forward" | "backward" | "apply"
    device_ids: tuple[int, ...]  # the jax device ids of the stage's sub-mesh
    lowered: Any  # jax.stages.Lowered
    compiled: list[Any] = field(default_factory=list)  # filled once by compile() (or by lowering a backward)
    # the stage runs its layers' train graphs pinned op by op (``runtime/stage_train.py``): its backward's
    # collectives are the plan's, not XLA's choice for a transpose
    pinned_per_op: bool = False
    # per microbatch in flight, per-device bytes the runtime keeps between this stage's forward and backward
    # (forward executables only): the residuals, or (jax.vjp path) every output
    kept_bytes: float = 0.0

    @property
    def name(self) -> str:
        return f"stage {self.stage} {self.action}"

    def compile(self) -> Any:
        if not self.compiled:
            self.compiled.append(self.lowered.compile())
        return self.compiled[0]

    def __str__(self) -> str:
        return f"{self.name:22} on devices {list(self.device_ids)}"


@dataclass(frozen=True, eq=False)
class PipelineCompiled:
    """Every stage executable compiled (``executables`` in stage order: forward, backward, apply)."""

    executables: tuple[StageExecutable, ...]

    def __iter__(self) -> Iterator[tuple[StageExecutable, Any]]:
        return iter((e, e.compile()) for e in self.executables)

    def __getitem__(self, name: str) -> Any:
        return next(e.compile() for e in self.executables if e.name == name)

    def as_text(self) -> dict[str, str]:
        return {e.name: c.as_text() for e, c in self}


@dataclass(frozen=True, eq=False)
class PipelineLowered:
    """The stage executables of a pipelined step, lowered (``str()`` lists them)."""

    executables: tuple[StageExecutable, ...]
    num_microbatches: int
    schedule: str

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.executables)

    def __len__(self) -> int:
        return len(self.executables)

    def __iter__(self) -> Iterator[StageExecutable]:
        return iter(self.executables)

    def compile(self) -> PipelineCompiled:
        for e in self.executables:
            e.compile()
        return PipelineCompiled(self.executables)

    def __str__(self) -> str:
        head = (f"pipeline: {len({e.stage for e in self.executables})} stages, {self.schedule}, "
                f"B={self.num_microbatches}; {len(self.executables)} executables (each run per microbatch, "
                "apply once per step):")
        return "\n".join([head] + [f"  {e}" for e in self.executables])


def _sds(aval: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding)


def _with_shardings(tree: Any, shardings: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                                                  for x, s in zip(leaves, jax.tree_util.tree_leaves(shardings))])


def _shard_bytes(tree: Any) -> float:
    """Per-device bytes of a pytree of ShapeDtypeStructs with shardings."""
    return float(sum(np.prod(x.sharding.shard_shape(tuple(x.shape)), dtype=np.int64) * np.dtype(x.dtype).itemsize
                     for x in jax.tree_util.tree_leaves(tree)))


def lower_pipeline(step: PipelineStep) -> PipelineLowered:
    """Lower every stage executable of ``step`` at one microbatch (module docstring)."""
    fwd = step.parts.forward
    num_stages = len(step.programs)
    out: list[StageExecutable] = []
    for p in step.programs:
        s, mesh = p.index, step.meshes[p.index]
        ids = tuple(int(d.id) for d in mesh.devices.flat)
        params = [_sds(fwd.avals[fwd.invars[k]]) for k in p.param_leaves]
        index = [jax.ShapeDtypeStruct((), jnp.int32)] if step.draws is not None else []  # the microbatch's
        data = [_sds(fwd.avals[fwd.invars[k]]) for k in p.data_leaves] + index
        acts = [_sds(fwd.avals[v]) for v in p.in_acts]
        last = s == num_stages - 1
        pinned = step.runners[s] is not None
        if not last:
            forward = StageExecutable(s, "forward", ids, step.fwd_fns[s].lower(params, data, acts), pinned_per_op=pinned)
            out.append(forward)
        loss_acc = jax.ShapeDtypeStruct((), fwd.avals[fwd.outvar].dtype)
        if last:
            lowered = step.bwd_fns[s].lower(params, data, acts, params, loss_acc)
        elif step.recompute[s]:
            cts = [_sds(fwd.avals[v]) for v in p.out_acts]
            lowered = step.bwd_fns[s].lower(params, data, acts, cts, params)
        else:
            compiled = forward.compile()
            outs, kept = _with_shardings(jax.eval_shape(step.fwd_fns[s], params, data, acts),
                                         compiled.output_shardings)
            held = kept if pinned else (outs, kept)  # the runtime keeps the residuals (vjp: the pullback too)
            out[-1] = dataclasses.replace(forward, kept_bytes=_shard_bytes(held))
            acc = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=step.grad_sharding(s, k))
                   for x, k in zip(params, p.param_leaves)]
            if pinned:
                placed = [[_sds(fwd.avals[fwd.invars[k]], step.param_sharding(s, k)) for k in p.param_leaves],
                          [_sds(fwd.avals[fwd.invars[k]], step.data_sharding(s, k)) for k in p.data_leaves]
                          + [jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated(mesh))] * len(index)]
                cts = [_sds(fwd.avals[v], step.act_sharding(s, v)) for v in p.out_acts]
                lowered = step.bwd_fns[s].lower(*placed, kept, cts, acc)
            else:
                lowered = step.bwd_fns[s].lower(kept, outs, acc)
        out.append(StageExecutable(s, "backward", ids, lowered, pinned_per_op=pinned))
        entry = step.apply_fns[s]
        if entry is not None:
            fn, used, _outs = entry
            invars = step.parts.update.invars
            args = [_sds(invars[i].aval, where) for i, where in zip(used, step.apply_in_shardings[s])]
            out.append(StageExecutable(s, "apply", ids, fn.lower(*args)))
    return PipelineLowered(tuple(out), step.num_microbatches, str(step.schedule))
