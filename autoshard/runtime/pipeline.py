"""Pipeline runtime: stage executables on sub-meshes, GPipe / 1F1B over microbatches.

Built from a step taken apart by ``ir/split.py``, its layers (the forward
equations of each, ``passes/layers.py``) and a list of stages (layer range +
devices). Per stage s, each ``jax.jit``-ed on its own
``jax.sharding.Mesh`` over its devices:

- ``forward``: the stage's equations (its layers, plus the batch-only *free*
  equations it reads, recomputed) from its parameters, its microbatch slice of
  the batch and the activations entering it, to the activations leaving it;
- ``backward``: the pullback of ``jax.vjp`` of the same function, adding the
  parameter gradients into an accumulator (donated) and returning the
  gradient of the entering activations. By default the forward returns its
  ``jax.vjp`` pullback (a ``jax.tree_util.Partial`` whose leaves are the
  residuals) and the backward applies it: the residuals of every microbatch
  in flight are kept. With ``recompute=True`` only the stage's input
  activations are kept and the backward re-runs the forward. The last stage
  fuses its forward into its backward and also accumulates the loss;
- ``apply``: the optimizer update restricted to the step outputs this stage
  owns (the update jaxpr cut down by DCE), fed with the stage's accumulated
  gradients.

Intra-stage sharding: each stage runs its own intra-op plan on its sub-mesh
(``StageLayout``): a logical mesh of one or two axes, a storage spec per
parameter and per gradient accumulator (FSDP, ZeRO, TP: whatever the plan
chose), the step inputs the optimizer reads (its state in the accumulator's
layout), and the mesh axes that split the batch and the activations along
their leading dimension (when they divide it). Gradients accumulate in the
accumulator's layout; the update runs on the stage's mesh with its inputs in
their planned layouts. A layout without specs is data parallel: one axis
``dp``, parameters and optimizer state replicated. XLA (GSPMD) shards the
rest from these annotations.

Microbatching assumes the loss is a mean over the batch: microbatch losses and
gradients are averaged (the loss cotangent is 1/B). Every non-differentiated
loss-argument leaf whose leading dimension is the batch size is split into B
equal slices; others are passed whole.

The optimizer must act per leaf (optax ``adamw``, ``sgd``, ``adam``, ...):
each stage updates only its own parameters. A step output that depends on the
gradients of parameters owned by two stages (``optax.clip_by_global_norm``,
say) is refused with :class:`PipelineError`. A parameter read by several
stages (tied embeddings) is sent to each; their gradient contributions are
summed on its owner, the first stage that reads it.

Activations and their gradients move between stages with ``jax.device_put``
to the receiving stage's sharding: split over the receiving mesh's batch axes,
each device receives only its share (one send over the link between the two
sub-meshes); a receiving stage that takes the activation replicated gets it
split over its devices first and all-gathers it inside its own mesh
(``stage_layout.deliver``), never once per device over the slow link.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding

from autoshard.errors import PlanningError
from autoshard.ir.split import Forward, StepParts, VarId
from autoshard.runtime.schedules import PipelineSchedule, schedule_actions
from autoshard.runtime.stage_layout import StageLayout, deliver, planned_sharding, replicated, split_leading

__all__ = ["PipelineError", "PipelineStep", "StageLayout", "StageProgram", "assign_outputs", "stage_programs"]

log = logging.getLogger(__name__)

LayerEqns: TypeAlias = tuple[int, ...]  # the forward equation indices of one layer


class PipelineError(PlanningError):
    """The step cannot run as a pipeline; the message says why and what to change."""


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
    out_acts: tuple[VarId, ...]  # activations leaving (the last stage: the loss)

    def function(self, forward: Forward) -> Callable[[list[Any], list[Any], list[Any]], list[Any]]:
        invars = forward.invars

        def run(params: list[Any], data: list[Any], acts: list[Any]) -> list[Any]:
            env: dict[VarId, Any] = dict(forward.consts)
            env.update({invars[k]: v for k, v in zip(self.param_leaves, params)})
            env.update({invars[k]: v for k, v in zip(self.data_leaves, data)})
            env.update(zip(self.in_acts, acts))
            forward.run(self.eqns, env)
            return [env[v] for v in self.out_acts]

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
    last[out] = num_stages  # read "after" the last stage
    programs = []
    for s in range(num_stages):
        own = sorted(i for i, st in stage_of.items() if st == s)
        needed = _free_closure(forward, own, producer, stage_of)
        eqns = tuple(sorted(set(own) | needed))
        reads = {a for i in eqns for a in forward.eqns[i].ins if not isinstance(a, jcore.Literal)}
        in_acts = tuple(sorted(v for v, p in made.items() if p < s <= last.get(v, -1)))
        out_acts = (out,) if s == num_stages - 1 else tuple(
            sorted(v for v, p in made.items() if p <= s < last.get(v, -1)))
        programs.append(StageProgram(
            s, eqns, tuple(sorted(diff_pos[v] for v in reads if v in diff_pos)),
            tuple(sorted(data_pos[v] for v in reads if v in data_pos)), in_acts, out_acts))
    for p in programs:
        bad = [v for v in p.in_acts + p.out_acts if not jnp.issubdtype(forward.avals[v].dtype, jnp.floating)]
        if bad:
            raise PipelineError(f"stage {p.index} would exchange non-float activations "
                                f"{[forward.avals[v].str_short() for v in bad]}; move the cut (layer_boundary) "
                                "so that only float activations cross stages")
    return programs


def _free_closure(forward: Forward, own: Sequence[int], producer: dict[VarId, int],
                  stage_of: dict[int, int]) -> set[int]:
    """The free (batch-only) equations the given equations read, transitively."""
    needed: set[int] = set()
    stack = [a for i in own for a in forward.eqns[i].ins]
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
    deps = _var_deps(update, [0] * first_grad + [1 << g for g in range(parts.num_grads)])
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


# ---------------------------------------------------------------------------
# The runtime


class PipelineStep:
    """A pipelined train step: call it like the original function ``(params, opt_state, batch) -> outputs``."""

    def __init__(self, parts: StepParts, layers: Sequence[LayerEqns], stages: Sequence[StageLayout],
                 num_microbatches: int, schedule: PipelineSchedule, *, split_inputs: Sequence[bool], in_tree: Any,
                 out_tree: Any, out_paths: Sequence[str] = (), devices: Sequence[jax.Device] | None = None,
                 recompute: bool = False, compiler_options: dict[str, Any] | None = None) -> None:
        """``parts`` is the step traced at one microbatch (batch leaves cut to 1/B, see
        ``ir.split.microbatch_shapes``); ``layers`` are the forward equation indices of each layer; ``split_inputs`` marks the
        flat step inputs that are batch leaves, split into ``num_microbatches`` slices."""
        self.parts, self.layers, self.layouts = parts, tuple(tuple(x) for x in layers), tuple(stages)
        self.num_microbatches, self.schedule = int(num_microbatches), schedule
        self.in_tree, self.out_tree = in_tree, out_tree
        devices = list(devices if devices is not None else jax.devices())
        self.meshes = [Mesh(np.asarray([devices[i] for i in st.device_indices]).reshape(st.shape), st.names,
                            axis_types=(jax.sharding.AxisType.Auto,) * len(st.shape)) for st in stages]
        fwd = parts.forward
        self.programs = stage_programs(fwd, layers, [(st.first_layer, st.last_layer) for st in stages])
        self.actions = schedule_actions(schedule, len(stages), self.num_microbatches)
        self.split_inputs = tuple(bool(x) for x in split_inputs)
        self.recompute = tuple(bool(recompute or st.recompute) for st in stages)  # per stage
        self._jit_options: dict[str, Any] = {"compiler_options": dict(compiler_options)} if compiler_options else {}
        # gradient owners: the first stage that reads each differentiated leaf (stage 0 if none does)
        readers: dict[int, list[int]] = {}
        for p in self.programs:
            for k in p.param_leaves:
                readers.setdefault(k, []).append(p.index)
        self.readers = readers
        self.owner_of_grad = [readers.get(k, [0])[0] for k in parts.grad_for_leaf]
        self.out_stage = assign_outputs(parts, self.owner_of_grad, out_paths)
        self._build_executables()

    # ---- construction --------------------------------------------------
    def _act_sharding(self, s: int, var: VarId) -> NamedSharding:
        return split_leading(self.meshes[s], self.parts.forward.avals[var].shape, self.layouts[s].batch_axes)

    def _data_sharding(self, s: int, k: int) -> NamedSharding:
        return split_leading(self.meshes[s], self.parts.forward.avals[self.parts.forward.invars[k]].shape,
                              self.layouts[s].batch_axes)

    def _leaf_shape(self, k: int) -> tuple[int, ...]:
        return tuple(self.parts.forward.avals[self.parts.forward.invars[k]].shape)

    def param_sharding(self, s: int, k: int) -> NamedSharding:
        return planned_sharding(self.meshes[s], self.layouts[s].param_specs.get(k), self._leaf_shape(k))

    def grad_sharding(self, s: int, k: int) -> NamedSharding:
        return planned_sharding(self.meshes[s], self.layouts[s].grad_specs.get(k), self._leaf_shape(k))

    def _is_split(self, k: int) -> bool:
        src = self.parts.operand_inputs[k]
        return src is not None and self.split_inputs[src]

    def _build_executables(self) -> None:
        fwd = self.parts.forward
        num_stages = len(self.programs)
        scale = 1.0 / self.num_microbatches
        self.fwd_fns, self.bwd_fns = [], []
        for p in self.programs:
            mesh = self.meshes[p.index]
            rep = replicated(mesh)
            run = p.function(fwd)
            ps = [self.param_sharding(p.index, k) for k in p.param_leaves]
            gs = [self.grad_sharding(p.index, k) for k in p.param_leaves]
            ds = [self._data_sharding(p.index, k) for k in p.data_leaves]
            ins = [self._act_sharding(p.index, v) for v in p.in_acts]
            last = p.index == num_stages - 1
            outs = [rep] if last else [self._act_sharding(p.index, v) for v in p.out_acts]
            if self.recompute[p.index] or last:
                self.fwd_fns.append(jax.jit(run, in_shardings=(ps, ds, ins), out_shardings=outs, **self._jit_options))
            else:
                def fwd_keep(params, data, acts, run=run):
                    out, pullback = jax.vjp(lambda pr, ac: run(pr, data, ac), params, acts)
                    return out, pullback

                self.fwd_fns.append(jax.jit(fwd_keep, in_shardings=(ps, ds, ins), **self._jit_options))

            if last:
                def bwd(params, data, acts, acc, loss_acc, run=run):
                    (loss,), vjp = jax.vjp(lambda pr, ac: run(pr, data, ac), params, acts)
                    dparams, dacts = vjp([jnp.asarray(scale, loss.dtype)])
                    acc = [a + g for a, g in zip(acc, dparams)]
                    return acc, dacts, loss_acc + loss * scale

                self.bwd_fns.append(jax.jit(bwd, in_shardings=(ps, ds, ins, gs, rep),
                                            out_shardings=(gs, ins, rep), donate_argnums=(3, 4),
                                            **self._jit_options))
            elif self.recompute[p.index]:
                def bwd(params, data, acts, cts, acc, run=run):
                    _, vjp = jax.vjp(lambda pr, ac: run(pr, data, ac), params, acts)
                    dparams, dacts = vjp(cts)
                    return [a + g for a, g in zip(acc, dparams)], dacts

                self.bwd_fns.append(jax.jit(bwd, in_shardings=(ps, ds, ins, outs, gs),
                                            out_shardings=(gs, ins), donate_argnums=(4,),
                                            **self._jit_options))
            else:
                def bwd_keep(pullback, cts, acc):
                    dparams, dacts = pullback(cts)
                    return [a + g for a, g in zip(acc, dparams)], dacts

                self.bwd_fns.append(jax.jit(bwd_keep, out_shardings=(gs, ins), donate_argnums=(2,), **self._jit_options))
        self._build_apply()

    def _build_apply(self) -> None:
        parts = self.parts
        update = parts.update
        self.apply_fns: list[tuple[Callable[..., Any], tuple[int, ...], tuple[int, ...]] | None] = []
        self.apply_in_shardings: list[list[NamedSharding]] = []
        for s in range(len(self.programs)):
            outs = tuple(k for k, st in enumerate(self.out_stage) if st == s)
            if not outs:
                self.apply_fns.append(None)
                self.apply_in_shardings.append([])
                continue
            jx = pe.dce_jaxpr(update, [k in outs for k in range(len(update.outvars))], instantiate=True)
            sub, used = jx
            used_idx = tuple(i for i, u in enumerate(used) if u)
            closed = jcore.ClosedJaxpr(sub, [])
            shardings = [self._update_input_sharding(s, i) for i in used_idx]
            fn = jax.jit(jcore.jaxpr_as_fun(closed), in_shardings=shardings, **self._jit_options)
            self.apply_fns.append((fn, used_idx, outs))
            self.apply_in_shardings.append(shardings)

    def _update_input_sharding(self, s: int, i: int) -> NamedSharding:
        """Update-jaxpr input i ([*consts, *step inputs, loss, *grads]) in stage s's planned layout."""
        parts, mesh = self.parts, self.meshes[s]
        shape = tuple(parts.update.invars[i].aval.shape)
        flat = i - parts.num_consts
        if 0 <= flat < parts.num_inputs:
            return planned_sharding(mesh, self.layouts[s].input_specs.get(flat), shape)
        grad = flat - parts.num_inputs - 1
        if 0 <= grad < parts.num_grads:
            return self.grad_sharding(s, parts.grad_for_leaf[grad])
        return replicated(mesh)

    # ---- running ---------------------------------------------------------
    def flatten_args(self, args: Sequence[Any]) -> list[Any]:
        leaves, tree = jax.tree_util.tree_flatten(tuple(args))
        if tree != self.in_tree:
            raise ValueError(f"arguments do not match the planned signature:\n  planned {self.in_tree}\n  got     {tree}")
        return leaves

    def __call__(self, *args: Any) -> Any:
        return jax.tree_util.tree_unflatten(self.out_tree, self.run_flat(self.flatten_args(args)))

    def _leaf_value(self, flat: Sequence[Any], k: int) -> Any:
        src = self.parts.operand_inputs[k]
        return flat[src] if src is not None else self.parts.operand_consts[k]

    def run_flat(self, flat: Sequence[Any]) -> list[Any]:
        fwd = self.parts.forward
        num_stages, num_mb = len(self.programs), self.num_microbatches
        params = [[jax.device_put(self._leaf_value(flat, k), self.param_sharding(p.index, k))
                   for k in p.param_leaves] for p in self.programs]
        data = []  # [stage][microbatch] -> leaves
        for p in self.programs:
            per_mb = []
            for m in range(num_mb):
                leaves = []
                for k in p.data_leaves:
                    x = self._leaf_value(flat, k)
                    if self._is_split(k):
                        size = x.shape[0] // num_mb
                        x = x[m * size:(m + 1) * size]
                    leaves.append(jax.device_put(x, self._data_sharding(p.index, k)))
                per_mb.append(leaves)
            data.append(per_mb)
        acc = [[jnp.zeros(fwd.avals[fwd.invars[k]].shape, fwd.avals[fwd.invars[k]].dtype,
                          device=self.grad_sharding(p.index, k)) for k in p.param_leaves] for p in self.programs]
        loss_acc = jnp.zeros((), fwd.avals[fwd.outvar].dtype, device=replicated(self.meshes[-1]))
        inbox: dict[tuple[int, int], list[Any]] = {(0, m): [] for m in range(num_mb)}
        ctbox: dict[tuple[int, int], list[Any]] = {}
        stash: dict[tuple[int, int], Any] = {}  # pullbacks (residuals) of microbatches in flight
        for kind, s, m in self.actions:
            last = s == num_stages - 1
            if kind == "F":
                if last:
                    continue  # fused into the last stage's backward
                acts = inbox.pop((s, m)) if not self.recompute[s] else inbox[(s, m)]
                out = self.fwd_fns[s](params[s], data[s][m], acts)
                if not self.recompute[s]:
                    out, stash[(s, m)] = out
                inbox[(s + 1, m)] = [deliver(x, self._act_sharding(s + 1, v))
                                     for x, v in zip(out, self.programs[s].out_acts)]
                continue
            if last:
                acts = inbox.pop((s, m))
                acc[s], dacts, loss_acc = self.bwd_fns[s](params[s], data[s][m], acts, acc[s], loss_acc)
            elif self.recompute[s]:
                acc[s], dacts = self.bwd_fns[s](params[s], data[s][m], inbox.pop((s, m)), ctbox.pop((s, m)), acc[s])
            else:
                acc[s], dacts = self.bwd_fns[s](stash.pop((s, m)), ctbox.pop((s, m)), acc[s])
            if s > 0:
                ctbox[(s - 1, m)] = [deliver(x, self._act_sharding(s - 1, v))
                                     for x, v in zip(dacts, self.programs[s - 1].out_acts)]
        return self._apply(flat, acc, loss_acc)

    def _apply(self, flat: Sequence[Any], acc: list[list[Any]], loss: Any) -> list[Any]:
        parts, fwd = self.parts, self.parts.forward
        grads: list[Any] = []
        for g, k in enumerate(parts.grad_for_leaf):
            owner = self.owner_of_grad[g]
            where = self.grad_sharding(owner, k)
            total = None
            for s in self.readers.get(k, []):
                part = jax.device_put(acc[s][self.programs[s].param_leaves.index(k)], where)
                total = part if total is None else total + part
            if total is None:
                aval = fwd.avals[fwd.invars[k]]
                total = jnp.zeros(aval.shape, aval.dtype, device=where)
            grads.append(total)
        consts = list(parts.closed.consts)
        env = [*consts, *flat, loss, *grads]
        outputs: list[Any] = [None] * len(parts.update.outvars)
        for s, entry in enumerate(self.apply_fns):
            if entry is None:
                continue
            fn, used, outs = entry
            vals = fn(*[jax.device_put(env[i], where) for i, where in zip(used, self.apply_in_shardings[s])])
            for k, v in zip(outs, vals):
                outputs[k] = v
        return outputs
