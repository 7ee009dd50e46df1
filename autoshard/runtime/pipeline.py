"""Pipeline runtime: stage executables on sub-meshes, GPipe / 1F1B over microbatches.

Built from a ``PipelineRun`` (``runtime/stage_layout.py``): a step taken apart
by ``ir/split.py`` at one microbatch, its layers (the forward equations of
each, ``passes/layers.py``) and a list of stages (layer range + devices), as a
plan gives them (``runtime/applied_pipeline.py``). Per stage s, each
``jax.jit``-ed on its own
``jax.sharding.Mesh`` over its devices:

- ``forward``: the stage's equations (its layers, plus the batch-only *free*
  equations it reads, recomputed) from its parameters, its microbatch slice of
  the batch and the activations entering it, to the activations leaving it;
- ``backward``: the gradients of the same function, added into an accumulator
  (donated), and the gradient of the entering activations. A stage whose
  layers carry their train-graph plans (``StageLayout.train_pins``) runs its
  layers' train graphs, cut into a forward and a backward half, every op pinned
  to its plan (``runtime/stage_train.py``): the forward returns the residuals
  its backward reads, kept per microbatch in flight. Otherwise (a plan file
  without them, a scanned stack) the backward is the pullback of ``jax.vjp``
  of the pinned forward: the forward returns the pullback (a
  ``jax.tree_util.Partial`` whose leaves are the residuals) and the backward
  applies it. With ``recompute=True`` only the stage's input activations are
  kept and the backward re-runs the forward. The last stage fuses its forward
  into its backward and also accumulates the loss;
- ``apply``: the optimizer update restricted to the step outputs this stage
  owns (the update jaxpr cut down by DCE), fed with the stage's accumulated
  gradients.

Intra-stage sharding: each stage runs its own intra-op plan on its sub-mesh
(``StageLayout``): a logical mesh of one or two axes, a storage spec per
parameter and per gradient accumulator (FSDP, ZeRO, TP: whatever the plan
chose), the step inputs the optimizer reads (its state in the accumulator's
layout), and the mesh axes that split the batch and the activations along
their leading dimension (when they divide it). Inside the forward every
planned equation output is pinned to its layer plan's spec and planned
reshards run as pinned chains: on the train graphs (``stage_train.py``), every op
of the backward too; on the ``jax.vjp`` path the forward equations
(``stage_pins.py``), the backward inheriting them. Gradients accumulate in the
accumulator's layout; the update runs on the stage's mesh with its inputs in
their planned layouts and, when the layout plans them (``output_specs``),
leaves the updated parameters and optimizer state in them. A layout without
specs is data parallel: one axis ``dp``, parameters and optimizer state
replicated. XLA (GSPMD) shards the rest from these annotations.

Microbatching assumes the loss is a mean over the batch: microbatch losses and
gradients are averaged (the loss cotangent is 1/B). Every non-differentiated
loss-argument leaf whose leading dimension is the batch size is split into B
equal slices; others are passed whole.

The optimizer must act per leaf (optax ``adamw``, ``sgd``, ``adam``, ...):
each stage updates only its own parameters. A step output that depends on the
gradients of parameters owned by two stages (``optax.clip_by_global_norm``,
say) is refused with ``errors.PipelineError``. A parameter read by several
stages (tied embeddings) is sent to each; their gradient contributions are
summed on its owner, the first stage that reads it.

Activations and their gradients move between stages with ``jax.device_put``
to the receiving stage's sharding: split over the receiving mesh's batch axes,
each device receives only its share (one send over the link between the two
sub-meshes); a receiving stage that takes the activation replicated gets it
split over its devices first and all-gathers it inside its own mesh
(``stage_layout.deliver``), never once per device over the slow link.

Loss arguments the step computes before the loss run first (``runtime/loss_io.Prologue``);
with ``has_aux=True`` the last stage also returns each microbatch's aux outputs, combined
by ``loss_io.combine_aux``. In a multi-process job every process builds every stage and
runs those whose devices it holds; values crossing processes move with
``runtime/cross_process.send`` and outputs held by another process come back as stand-ins.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding

from autoshard.ir.split import VarId
from autoshard.ir.stage_programs import StageProgram, assign_outputs, stage_programs
from autoshard.ir.train_graph import one_layer_programs
from autoshard.plans.schedules import chunks_of, schedule_actions
from autoshard.runtime.cross_process import holds, placeholder, send, single_process
from autoshard.runtime.loss_io import Prologue, aux_per_example, combine_aux
from autoshard.runtime.microbatch_bits import drawing
from autoshard.runtime.stage_layout import (PipelineRun, StepOptions, deliver, planned_sharding, replicated,
                                            split_leading)
from autoshard.runtime.stage_pins import stage_hooks
from autoshard.runtime.stage_train import StageRunner, stage_runner

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# The runtime


class PipelineStep:
    """A pipelined train step: call it like the original function ``(params, opt_state, batch) -> outputs``."""

    def __init__(self, run: PipelineRun, devices: Sequence[jax.Device] | None = None,
                 options: StepOptions = StepOptions()) -> None:
        """``run``: the step at one microbatch and the plan's stages (``runtime/stage_layout.PipelineRun``);
        ``devices``: what the layouts' device indices name (default ``jax.devices()``)."""
        parts, stages = run.parts, run.layouts
        self.parts, self.layers, self.layouts = parts, tuple(tuple(x) for x in run.layers), tuple(stages)
        self.num_microbatches, self.schedule = int(run.num_microbatches), run.schedule
        self.draws = run.draws  # draws over the batch: each stage's data ends with the microbatch index
        self.in_tree, self.out_tree = run.in_tree, run.out_tree
        devices = list(devices if devices is not None else jax.devices())
        self.meshes = [Mesh(np.asarray([devices[i] for i in st.device_indices]).reshape(st.shape), st.names,
                            axis_types=(jax.sharding.AxisType.Auto,) * len(st.shape)) for st in stages]
        fwd = parts.forward
        self.programs = stage_programs(fwd, self.layers, [(st.first_layer, st.last_layer) for st in stages])
        self.actions = schedule_actions(run.schedule, len(stages), self.num_microbatches,
                                        chunks_of(run.schedule, [st.device_indices for st in stages]))
        self.split_inputs = tuple(bool(x) for x in run.split_inputs)
        self.recompute = tuple(bool(options.recompute or st.recompute) for st in stages)  # per stage
        self._jit_options: dict[str, Any] = (
            {"compiler_options": dict(options.compiler_options)} if options.compiler_options else {})
        out_paths = run.out_paths
        # gradient owners: the first stage that reads each differentiated leaf (stage 0 if none does)
        readers: dict[int, list[int]] = {}
        for p in self.programs:
            for k in p.param_leaves:
                readers.setdefault(k, []).append(p.index)
        self.readers = readers
        self.owner_of_grad = [readers.get(k, [0])[0] for k in parts.grad_for_leaf]
        self.out_stage = assign_outputs(parts, self.owner_of_grad, out_paths)
        self.aux_per_example = aux_per_example(parts, self.split_inputs)
        self.prologue = Prologue(parts, self.split_inputs, self.num_microbatches, self._jit_options)
        self._build_executables()

    # ---- construction --------------------------------------------------
    def act_sharding(self, s: int, var: VarId) -> NamedSharding:
        return split_leading(self.meshes[s], self.parts.forward.avals[var].shape, self.layouts[s].split_axes)

    def data_sharding(self, s: int, k: int) -> NamedSharding:
        return split_leading(self.meshes[s], self.parts.forward.avals[self.parts.forward.invars[k]].shape,
                             self.layouts[s].split_axes)

    def _leaf_shape(self, k: int) -> tuple[int, ...]:
        return tuple(self.parts.forward.avals[self.parts.forward.invars[k]].shape)

    def param_sharding(self, s: int, k: int) -> NamedSharding:
        return planned_sharding(self.meshes[s], self.layouts[s].param_specs.get(k), self._leaf_shape(k))

    def grad_sharding(self, s: int, k: int) -> NamedSharding:
        return planned_sharding(self.meshes[s], self.layouts[s].grad_specs.get(k), self._leaf_shape(k))

    def _is_split(self, k: int) -> bool:
        src = self.parts.operand_inputs[k]
        return src is not None and self.split_inputs[src]

    def _runner(self, p: StageProgram, graphs: dict[Any, Any]) -> StageRunner | None:
        """The stage's train-graph runner (``runtime/stage_train.py``), or None (the jax.vjp path, logged why)."""
        layout = self.layouts[p.index]
        if not layout.train_pins:
            return None
        if self._layer_programs is None:
            self._layer_programs = one_layer_programs(self.parts.forward, self.layers)
        runner, why = stage_runner(self.parts.forward, p, self._layer_programs, layout.train_pins,
                                   layout.first_layer, layout.last_layer, self.meshes[p.index], graphs,
                                   layout.edge_pins)
        if runner is None:
            log.warning("pipeline stage %d runs jax.vjp of its pinned forward, not its planned backward: %s",
                        p.index, why)
        return runner

    def _build_executables(self) -> None:
        num_stages = len(self.programs)
        self.fwd_fns, self.bwd_fns = [], []
        self._layer_programs: list[StageProgram] | None = None
        graphs: dict[Any, Any] = {}  # traced train graphs, shared by the stages (stage_train.stage_runner)
        self.runners = [self._runner(p, graphs) for p in self.programs]
        for p in self.programs:
            last = p.index == num_stages - 1
            if self.runners[p.index] is not None:
                self._build_train_stage(p, self.runners[p.index], last)
            else:
                self._build_vjp_stage(p, last)
        self._build_apply()

    def _stage_shardings(self, p: StageProgram) -> tuple[list[NamedSharding], ...]:
        """(params, grads, data, entering activations, leaving activations) of stage p."""
        s = p.index
        last = s == len(self.programs) - 1
        index = [replicated(self.meshes[s])] if self.draws is not None else []
        return ([self.param_sharding(s, k) for k in p.param_leaves], [self.grad_sharding(s, k) for k in p.param_leaves],
                [self.data_sharding(s, k) for k in p.data_leaves] + index, [self.act_sharding(s, v) for v in p.in_acts],
                [replicated(self.meshes[s])] * len(p.out_acts) if last else [self.act_sharding(s, v) for v in p.out_acts])

    def _drawing(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn(params, data, ...)`` given data ending with the microbatch index (when the loss draws over the
        batch): run with its draws made as the microbatch's slice (``runtime/microbatch_bits.py``)."""
        draws = self.draws
        if draws is None:
            return fn

        def run(params: Any, data: Sequence[Any], *rest: Any) -> Any:
            with drawing(draws, data[-1]):
                return fn(params, data[:-1], *rest)

        return run

    def _build_train_stage(self, p: StageProgram, runner: StageRunner, last: bool) -> None:
        """Stage p running its layers' train graphs (``runtime/stage_train.py``): the forward returns the
        residuals its backward reads; a recomputing stage and the last stage run both halves in one program."""
        rep = replicated(self.meshes[p.index])
        ps, gs, ds, ins, outs = self._stage_shardings(p)
        scale = 1.0 / self.num_microbatches
        opts = self._jit_options
        if last or self.recompute[p.index]:  # the forward's residuals are not kept: its outputs only
            self.fwd_fns.append(jax.jit(self._drawing(lambda params, data, acts: runner.forward(params, data, acts)[0]),
                                        in_shardings=(ps, ds, ins), out_shardings=outs, **opts))
        else:  # keep: the residuals of every microbatch in flight, in the layouts the forward leaves them
            self.fwd_fns.append(jax.jit(self._drawing(runner.forward), in_shardings=(ps, ds, ins), **opts))
        if last:
            def bwd(params, data, acts, acc, loss_acc):
                out, stash = runner.forward(params, data, acts)
                acc, dacts = runner.backward(params, data, stash, runner.loss_cotangents(out, scale), acc)
                return acc, dacts, loss_acc + out[0] * scale, out[1:]

            self.bwd_fns.append(jax.jit(self._drawing(bwd), in_shardings=(ps, ds, ins, gs, rep),
                                        out_shardings=(gs, ins, rep, [rep] * len(self.parts.forward.aux)),
                                        donate_argnums=(3, 4), **opts))
        elif self.recompute[p.index]:
            def bwd(params, data, acts, cts, acc):
                _, stash = runner.forward(params, data, acts)
                return runner.backward(params, data, stash, cts, acc)

            self.bwd_fns.append(jax.jit(self._drawing(bwd), in_shardings=(ps, ds, ins, outs, gs),
                                        out_shardings=(gs, ins), donate_argnums=(4,), **opts))
        else:
            self.bwd_fns.append(jax.jit(self._drawing(runner.backward), out_shardings=(gs, ins), donate_argnums=(4,),
                                        **opts))

    def _build_vjp_stage(self, p: StageProgram, last: bool) -> None:
        """Stage p as ``jax.vjp`` of its pinned forward equations (no train-graph plan: module docstring)."""
        fwd = self.parts.forward
        scale = 1.0 / self.num_microbatches
        mesh = self.meshes[p.index]
        rep = replicated(mesh)
        run = p.function(fwd, *stage_hooks(fwd, self.layouts[p.index], mesh))
        ps, gs, ds, ins, outs = self._stage_shardings(p)
        if self.recompute[p.index] or last:
            self.fwd_fns.append(jax.jit(self._drawing(run), in_shardings=(ps, ds, ins), out_shardings=outs,
                                        **self._jit_options))
        else:
            def fwd_keep(params, data, acts):
                out, pullback = jax.vjp(lambda pr, ac: run(pr, data, ac), params, acts)
                return out, pullback

            self.fwd_fns.append(jax.jit(self._drawing(fwd_keep), in_shardings=(ps, ds, ins), **self._jit_options))

        if last:
            def bwd(params, data, acts, acc, loss_acc):
                def loss_and_aux(pr, ac):
                    loss, *aux = run(pr, data, ac)
                    return [loss], aux

                (loss,), vjp, aux = jax.vjp(loss_and_aux, params, acts, has_aux=True)
                dparams, dacts = vjp([jnp.asarray(scale, loss.dtype)])
                acc = [a + g for a, g in zip(acc, dparams)]
                return acc, dacts, loss_acc + loss * scale, aux

            self.bwd_fns.append(jax.jit(self._drawing(bwd), in_shardings=(ps, ds, ins, gs, rep),
                                        out_shardings=(gs, ins, rep, [rep] * len(fwd.aux)),
                                        donate_argnums=(3, 4), **self._jit_options))
        elif self.recompute[p.index]:
            def bwd(params, data, acts, cts, acc):
                _, vjp = jax.vjp(lambda pr, ac: run(pr, data, ac), params, acts)
                dparams, dacts = vjp(cts)
                return [a + g for a, g in zip(acc, dparams)], dacts

            self.bwd_fns.append(jax.jit(self._drawing(bwd), in_shardings=(ps, ds, ins, outs, gs),
                                        out_shardings=(gs, ins), donate_argnums=(4,),
                                        **self._jit_options))
        else:
            def bwd_keep(pullback, cts, acc):
                dparams, dacts = pullback(cts)
                return [a + g for a, g in zip(acc, dparams)], dacts

            self.bwd_fns.append(jax.jit(bwd_keep, out_shardings=(gs, ins), donate_argnums=(2,), **self._jit_options))

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
            # instantiate=False: the inputs it does not read are dropped (True would keep every input)
            jx = pe.dce_jaxpr(update, [k in outs for k in range(len(update.outvars))], instantiate=False)
            sub, used = jx
            used_idx = tuple(i for i, u in enumerate(used) if u)
            closed = jcore.ClosedJaxpr(sub, [])
            shardings = [self._update_input_sharding(s, i) for i in used_idx]
            planned = self.layouts[s].output_specs
            out_shardings = {"out_shardings": [self.output_sharding(s, k) for k in outs]} if planned else {}
            fn = jax.jit(jcore.jaxpr_as_fun(closed), in_shardings=shardings, **out_shardings, **self._jit_options)
            self.apply_fns.append((fn, used_idx, outs))
            self.apply_in_shardings.append(shardings)

    def output_sharding(self, s: int, k: int) -> NamedSharding:
        """Step output k as stage s's apply leaves it: updated state in its planned layout, others replicated."""
        shape = tuple(self.parts.update.outvars[k].aval.shape)
        return planned_sharding(self.meshes[s], self.layouts[s].output_specs.get(k), shape)

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

    def _leaf_value(self, flat: Sequence[Any], k: int, computed: dict[int, Any] | None = None) -> Any:
        src = self.parts.operand_inputs[k]
        if src is not None:
            return flat[src]
        if computed is not None and k in computed:
            return computed[k]
        return self.parts.operand_consts[k]

    def run_flat(self, flat: Sequence[Any]) -> list[Any]:
        """One step on flat inputs. In a multi-process job every process calls it alike; each runs the stages
        whose devices it holds and joins the sends into and out of them (``runtime/cross_process.py``)."""
        fwd = self.parts.forward
        num_stages, num_mb = len(self.programs), self.num_microbatches
        here = [holds(mesh) for mesh in self.meshes]
        computed = self.prologue.leaves(flat)
        params = [[jax.device_put(self._leaf_value(flat, k, computed[0]), self.param_sharding(p.index, k))
                   for k in p.param_leaves] if here[p.index] else None for p in self.programs]
        data = []  # [stage][microbatch] -> leaves
        for p in self.programs:
            per_mb = []
            for m in range(num_mb if here[p.index] else 0):
                leaves = []
                for k in p.data_leaves:
                    x = self._leaf_value(flat, k, computed[m])
                    if self._is_split(k):
                        size = x.shape[0] // num_mb
                        x = x[m * size:(m + 1) * size]
                    leaves.append(jax.device_put(x, self.data_sharding(p.index, k)))
                if self.draws is not None:
                    leaves.append(jax.device_put(np.int32(m), replicated(self.meshes[p.index])))
                per_mb.append(leaves)
            data.append(per_mb)
        acc = [[jnp.zeros(fwd.avals[fwd.invars[k]].shape, fwd.avals[fwd.invars[k]].dtype,
                          device=self.grad_sharding(p.index, k)) for k in p.param_leaves]
               if here[p.index] else None for p in self.programs]
        loss_acc = jnp.zeros((), fwd.avals[fwd.outvar].dtype, device=replicated(self.meshes[-1])) if here[-1] else None
        aux: list[list[Any]] = []  # per microbatch, the aux outputs
        inbox: dict[tuple[int, int], list[Any]] = {(0, m): [] for m in range(num_mb)}
        ctbox: dict[tuple[int, int], list[Any]] = {}
        stash: dict[tuple[int, int], Any] = {}  # pullbacks (residuals) of microbatches in flight
        for kind, s, m in self.actions:
            last = s == num_stages - 1
            if kind == "F":
                if last:
                    continue  # fused into the last stage's backward
                acts = inbox.pop((s, m)) if not self.recompute[s] else inbox[(s, m)]
                out = self.fwd_fns[s](params[s], data[s][m], acts) if here[s] else None
                if here[s] and not self.recompute[s]:
                    out, stash[(s, m)] = out
                inbox[(s + 1, m)] = self._send(out, s, s + 1, self.programs[s].out_acts)
                continue
            dacts = None
            if not here[s]:
                inbox.pop((s, m), None)
                ctbox.pop((s, m), None)
            elif last:
                acts = inbox.pop((s, m))
                acc[s], dacts, loss_acc, aux_m = self.bwd_fns[s](params[s], data[s][m], acts, acc[s], loss_acc)
                aux.append(aux_m)
            elif self.recompute[s]:
                acc[s], dacts = self.bwd_fns[s](params[s], data[s][m], inbox.pop((s, m)), ctbox.pop((s, m)), acc[s])
            elif self.runners[s] is not None:
                acc[s], dacts = self.bwd_fns[s](params[s], data[s][m], stash.pop((s, m)), ctbox.pop((s, m)), acc[s])
            else:
                acc[s], dacts = self.bwd_fns[s](stash.pop((s, m)), ctbox.pop((s, m)), acc[s])
            if s > 0:
                ctbox[(s - 1, m)] = self._send(dacts, s, s - 1, self.programs[s - 1].out_acts)
        return self._apply(flat, acc, loss_acc, combine_aux(self.aux_per_example, aux) if here[-1] else None)

    def _send(self, values: Sequence[Any] | None, src: int, dst: int, var_ids: Sequence[VarId]) -> list[Any] | None:
        """Activations (or their gradients) of stage ``src`` laid out for stage ``dst``; None on a process
        holding neither stage (and on one holding only ``src``, when another holds ``dst``)."""
        src_mesh, dst_mesh = self.meshes[src], self.meshes[dst]
        if not (holds(src_mesh) or holds(dst_mesh)):
            return None
        avals = [self.parts.forward.avals[v] for v in var_ids]
        shardings = [self.act_sharding(dst, v) for v in var_ids]
        if single_process(src_mesh, dst_mesh):
            return [deliver(x, sh) for x, sh in zip(values, shardings)]
        values = values if values is not None else [None] * len(var_ids)
        out = [send(x, src_mesh, sh, a.shape, a.dtype) for x, sh, a in zip(values, shardings, avals)]
        return out if holds(dst_mesh) else None

    def _apply(self, flat: Sequence[Any], acc: list[Any], loss: Any, aux: Sequence[Any] | None) -> list[Any]:
        parts, fwd = self.parts, self.parts.forward
        first_grad = parts.num_consts + parts.num_inputs + 1
        source = {first_grad - 1: len(self.programs) - 1}  # where each loss / grad / aux value lives
        grads: list[Any] = []
        for g, k in enumerate(parts.grad_for_leaf):
            owner = self.owner_of_grad[g]
            where = self.grad_sharding(owner, k)
            aval = fwd.avals[fwd.invars[k]]
            total = None
            for s in self.readers.get(k, []):
                mine = acc[s][self.programs[s].param_leaves.index(k)] if acc[s] is not None else None
                part = send(mine, self.meshes[s], where, aval.shape, aval.dtype) \
                    if holds(self.meshes[s]) or holds(self.meshes[owner]) else None
                total = part if total is None else total + part
            if total is None and holds(self.meshes[owner]):
                total = jnp.zeros(aval.shape, aval.dtype, device=where)
            grads.append(total)
            source[first_grad + g] = owner
        for j in range(parts.num_aux):
            source[first_grad + parts.num_grads + j] = len(self.programs) - 1
        consts = list(parts.closed.consts)
        env = [*consts, *flat, loss, *grads, *(aux if aux is not None else [None] * parts.num_aux)]
        outputs: list[Any] = [None] * len(parts.update.outvars)
        invars = parts.update.invars
        for s, entry in enumerate(self.apply_fns):
            if entry is None:
                continue
            fn, used, outs = entry
            vals = []
            for i, where in zip(used, self.apply_in_shardings[s]):
                if i in source:
                    src = self.meshes[source[i]]
                    if holds(src) or holds(self.meshes[s]):
                        vals.append(send(env[i], src, where, invars[i].aval.shape, invars[i].aval.dtype))
                else:
                    vals.append(jax.device_put(env[i], where) if holds(self.meshes[s]) else None)
            if holds(self.meshes[s]):
                results = fn(*vals)
            else:  # another process computes these outputs: stand-ins on its devices
                rep = replicated(self.meshes[s])
                results = [placeholder(rep, parts.update.outvars[k].aval.shape, parts.update.outvars[k].aval.dtype)
                           for k in outs]
            for k, v in zip(outs, results):
                outputs[k] = v
        return outputs
