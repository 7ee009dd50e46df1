"""Stage programs: which forward equations each pipeline stage runs, what crosses each boundary, and
which stage owns each output of the optimizer update.

Plain functions of a split step (``ir/split.py``) and a cut into layers: the planner prices the programs
(one per layer, ``ir/train_graph.py``), the runtime runs one per stage (``runtime/pipeline.py``)."""
from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import jax.numpy as jnp
from jax.extend import core as jcore

from autoshard.errors import PipelineError
from autoshard.ir.split import EqnHook, Forward, StepParts, VarId


LayerEqns: TypeAlias = tuple[int, ...]  # the forward equation indices of one layer


# ---------------------------------------------------------------------------
# Stage programs


@dataclass(frozen=True, eq=False)
class StageProgram:
    """What stage s computes, in forward variables."""

    index: int
    eqns: tuple[int, ...]  # forward equations, program order (free ones included)
    param_leaves: tuple[int, ...]  # differentiated loss-argument leaves it reads
    data_leaves: tuple[int, ...]  # other loss-argument leaves it reads
    in_acts: tuple[VarId, ...]  # activations entering
    out_acts: tuple[Any, ...]  # activations leaving (the last stage: the loss, then the aux outputs)

    def function(self, forward: Forward, before: EqnHook | None = None, after: EqnHook | None = None
                 ) -> Callable[[list[Any], list[Any], list[Any]], list[Any]]:
        """``(params, data, acts) -> out_acts``; ``before``/``after`` as in ``Forward.run`` (planned layouts)."""
        invars = forward.invars

        def run(params: list[Any], data: list[Any], acts: list[Any]) -> list[Any]:
            env: dict[VarId, Any] = dict(forward.consts)
            env.update({invars[k]: v for k, v in zip(self.param_leaves, params)})
            env.update({invars[k]: v for k, v in zip(self.data_leaves, data)})
            env.update(zip(self.in_acts, acts))
            forward.run(self.eqns, env, before, after)
            return [v.val if isinstance(v, jcore.Literal) else env[v] for v in self.out_acts]

        return run


def stage_programs(forward: Forward, layers: Sequence[LayerEqns], ranges: Sequence[tuple[int, int]]
                   ) -> list[StageProgram]:
    """Assign the forward's equations to stages and find what crosses each boundary."""
    num_stages = len(ranges)
    stage_of: dict[int, int] = {}
    for s, (a, b) in enumerate(ranges):
        for layer in layers[a: b + 1]:
            for i in layer:
                stage_of[i] = s
    producer = {v: i for i, e in enumerate(forward.eqns) for v in e.outs}
    diff_pos = {v: k for k, (v, d) in enumerate(zip(forward.invars, forward.diff)) if d}
    data_pos = {v: k for k, (v, d) in enumerate(zip(forward.invars, forward.diff)) if not d}
    # the stage where each parameter-dependent value is produced, and the last stage that reads it
    made: dict[VarId, int] = {}
    last: dict[VarId, int] = {}
    for i, e in enumerate(forward.eqns):
        if i in stage_of:
            for v in e.outs:
                made[v] = stage_of[i]
            for a in e.ins:
                if not isinstance(a, jcore.Literal) and a in made:
                    last[a] = max(last.get(a, -1), stage_of[i])
    out = forward.outvar
    if isinstance(out, jcore.Literal) or out not in made:
        raise PipelineError("the loss does not depend on the parameters through the layers: nothing to pipeline")
    aux = [a for a in forward.aux if not isinstance(a, jcore.Literal)]
    for v in (out, *aux):
        if v in made:
            last[v] = num_stages  # read "after" the last stage
    programs = []
    for s in range(num_stages):
        own = sorted(i for i, st in stage_of.items() if st == s)
        seeds = aux if s == num_stages - 1 else []  # the last stage also returns the aux outputs
        needed = free_closure(forward, own, producer, stage_of, seeds)
        eqns = tuple(sorted(set(own) | needed))
        reads = {a for i in eqns for a in forward.eqns[i].ins if not isinstance(a, jcore.Literal)} | set(seeds)
        in_acts = tuple(sorted(v for v, p in made.items() if p < s <= last.get(v, -1)))
        out_acts = (out, *forward.aux) if s == num_stages - 1 else tuple(
            sorted(v for v, p in made.items() if p <= s < last.get(v, -1)))
        programs.append(StageProgram(
            s, eqns, tuple(sorted(diff_pos[v] for v in reads if v in diff_pos)),
            tuple(sorted(data_pos[v] for v in reads if v in data_pos)), in_acts, out_acts))
    for p in programs:
        crossing = p.in_acts + (p.out_acts if p.index < num_stages - 1 else ())
        bad = [v for v in crossing if not jnp.issubdtype(forward.avals[v].dtype, jnp.floating)]
        if bad:
            raise PipelineError(f"stage {p.index} would exchange non-float activations "
                                f"{[forward.avals[v].str_short() for v in bad]}; move the cut (layer_boundary) "
                                "so that only float activations cross stages")
    return programs


def free_closure(forward: Forward, own: Sequence[int], producer: dict[VarId, int],
                 stage_of: Container[int], seeds: Sequence[VarId] = ()) -> set[int]:
    """The free (batch-only) equations the given equations (and the ``seeds`` values) read, transitively: every
    equation not in ``stage_of`` (the equations the layers hold) that they reach. A layer's program recomputes them
    (``passes/layers.py`` hashes them into its class)."""
    needed: set[int] = set()
    stack = [a for i in own for a in forward.eqns[i].ins] + list(seeds)
    while stack:
        a = stack.pop()
        if isinstance(a, jcore.Literal) or a not in producer:
            continue
        i = producer[a]
        if i in stage_of or i in needed:
            continue
        needed.add(i)
        stack.extend(forward.eqns[i].ins)
    return needed


# ---------------------------------------------------------------------------
# The optimizer update, split per stage


def _var_deps(jaxpr: Any, in_deps: list[int]) -> list[int]:
    """Bitmask dependencies of every outvar on the invars' bitmasks (through nested calls)."""
    env: dict[Any, int] = dict(zip(jaxpr.invars, in_deps))

    def read(a: Any) -> int:
        return 0 if isinstance(a, jcore.Literal) else env.get(a, 0)

    for e in jaxpr.eqns:
        ins = [read(a) for a in e.invars]
        body = e.params.get("jaxpr") if e.primitive.name in ("jit", "pjit", "closed_call") else None
        if body is not None:
            inner = body.jaxpr if isinstance(body, jcore.ClosedJaxpr) else body
            outs = _var_deps(inner, ins)
        elif e.primitive.name == "cond":  # each output: its own reads in every branch, and the branch index
            # (optax.MultiSteps's update is a cond over all leaves, each leaf's output its own leaf's)
            outs = [ins[0]] * len(e.outvars)
            for branch in e.params["branches"]:
                outs = [m | b for m, b in zip(outs, _var_deps(branch.jaxpr, ins[1:]))]
        else:
            mask = 0
            for m in ins:
                mask |= m
            outs = [mask] * len(e.outvars)
        for v, m in zip(e.outvars, outs):
            env[v] = m
    return [read(a) for a in jaxpr.outvars]


def assign_outputs(parts: StepParts, owner_of_grad: Sequence[int], out_paths: Sequence[str]) -> list[int]:
    """The stage that computes each step output: the owner of the gradients it reads (0 if none)."""
    update = parts.update
    first_grad = parts.num_consts + parts.num_inputs + 1
    deps = _var_deps(update, [0] * first_grad + [1 << g for g in range(parts.num_grads)] + [0] * parts.num_aux)
    stages = []
    for k, mask in enumerate(deps):
        owners = sorted({owner_of_grad[g] for g in range(parts.num_grads) if mask >> g & 1})
        if len(owners) > 1:
            raise PipelineError(
                f"step output {out_paths[k] if k < len(out_paths) else k} depends on the gradients of parameters "
                f"in pipeline stages {owners}: the optimizer couples parameters across stages (e.g. "
                "optax.clip_by_global_norm or a global gradient norm). Pipelines need a per-parameter optimizer "
                "(adamw, adam, sgd, ...); drop the coupling or use num_stages=1.")
        stages.append(owners[0] if owners else 0)
    return stages
