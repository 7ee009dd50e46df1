"""Read what XLA compiled: the collectives it emitted, how often they run, memory and flops.

This is the ground truth of the fidelity check (docs/ARCHITECTURE.md, "How a
plan is checked"): a plan's ledger predicts collectives and bytes; this module reads
them back from ``compiled.as_text()``, the optimized, partitioned HLO of one
device, and from ``compiled.memory_analysis()`` / ``cost_analysis()``.

What the reader knows about the text (checked on jax/jaxlib 0.10.2, XLA:CPU):

* Async collectives are ``X-start`` / ``X-done`` pairs: counted once, at the
  start, with the done's shape as the result. A collective wrapped in a
  generic ``async-start(..), calls=%c`` is counted inside ``%c``.
* XLA:CPU emits no ``reduce-scatter``: an ``all-reduce`` whose result only
  feeds ``dynamic-slice`` s (through bitcast / reshape / copy / fusion
  parameters) that keep 1/group_size of it is reported as a reduce-scatter
  with ``nbytes`` = the all-reduce buffer (its operand).
* A collective in a ``while`` body runs trip-count times: XLA writes
  ``"known_trip_count":{"n":"4"}`` into the while's ``backend_config``; failing
  that the condition's compare against a constant is read. Nested loops
  multiply. A loop whose trip count cannot be read counts once (logged).
* A ``conditional`` counts its costliest branch (most FLOPs, then bytes, with the
  computations it calls), the others not at all: the planner prices a cond so
  (``ir/trace.py``), and ``cost_analysis()`` takes the costliest branch too.
* XLA:CPU promotes bf16 collectives to f32 (a ``convert`` around them); the
  bytes here are what XLA moves, so they follow the promoted type.

Parsing the text (shapes, instructions, computations, replica-group
spellings) is in ``compiler/hlo_parse.py`` (``shape_nbytes`` and
``shape_elements`` are re-exported here, ``group_size_of`` lives there). This module
reads what the parsed module means: the collectives and their bytes, loop
trip counts, reduce-scatter recognition, and ``summarize_compiled``.
"""
from __future__ import annotations

import dataclasses

import functools
import json
import logging
import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from autoshard.compiler.hlo_bytes import xla_instruction_bytes
from autoshard.compiler.hlo_parse import (Computation, Instruction, HloModule, parse_module, permute_groups,
                                          replica_groups_of, split_top_level, shape_elements,
                                          shape_nbytes)

log = logging.getLogger(__name__)

HloCollectiveKind: TypeAlias = Literal[
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"
]
HLO_COLLECTIVE_KINDS: tuple[HloCollectiveKind, ...] = (
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
)


@dataclass(frozen=True)
class HloCollective:
    """One collective of the compiled module, as one device runs it."""

    kind: HloCollectiveKind
    nbytes: int  # per device: all-gather → result; reduce-scatter → operand; others → buffer
    group_size: int  # devices per replica group (permute: devices per connected ring)
    num_groups: int
    count: int  # times it runs: product of the trip counts of the loops around it
    text: str  # the instruction line, for reports
    # the device (partition) ids of each replica group; a collective-permute's (source, target) pairs
    groups: tuple[tuple[int, ...], ...] = ()

    @property
    def total_bytes(self) -> int:
        return self.nbytes * self.count

    def __str__(self) -> str:
        times = f" x{self.count}" if self.count != 1 else ""
        return f"{self.kind} {self.nbytes} B{times} over {self.num_groups}x{self.group_size}"


@dataclass(frozen=True)
class CompiledSummary:
    """What XLA compiled for one device: collectives, memory, flops."""

    collectives: tuple[HloCollective, ...]
    bytes_by_kind: dict[str, float]  # Σ nbytes*count per kind; every kind present
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int  # argument + output − alias + temp (XLA:CPU buffer assignment)
    flops: float | None  # cost_analysis()['flops'] per device, loop bodies times their trip counts
    bytes_accessed: float | None = None  # cost_analysis()['bytes accessed'] per device, loops likewise


# ----------------------------------------------------------------------------- loops


def _scalar_constant(comp: Computation, name: str) -> int | None:
    inst = comp.instructions.get(name)
    while inst is not None and inst.opcode in ("copy", "bitcast", "convert") and inst.operands:
        inst = comp.instructions.get(inst.operands[0])
    if inst is None or inst.opcode != "constant" or not re.fullmatch(r"[su]\d+\[\]", inst.shape.split("{")[0]):
        return None
    return int(inst.operands[0]) if inst.operands and inst.operands[0].lstrip("-").isdigit() else None


def _trip_count(loop: Instruction, caller: Computation, module: HloModule) -> int | None:
    config = loop.attrs.get("backend_config", "")
    try:
        n = json.loads(config).get("known_trip_count", {}).get("n")
        if n is not None:
            return int(n)
    except (ValueError, AttributeError):
        if m := re.search(r'"known_trip_count":\{"n":"(\d+)"', config):
            return int(m.group(1))
    return _trip_count_from_condition(loop, caller, module)


def _trip_count_from_condition(loop: Instruction, caller: Computation, module: HloModule) -> int | None:
    """``i < N`` (or ``<=``, ``>``, ``>=``) against a constant N, i from the init tuple, step 1."""
    cond = module.computations.get(loop.attrs.get("condition", "").lstrip("%"))
    root = next((i for i in cond.instructions.values() if i.is_root), None) if cond else None
    if root is None:
        return None
    compare, args = root, root.operands
    if root.opcode == "fusion":  # XLA:CPU wraps the compare: fusion(%gte, %constant), calls=...
        inner = module.computations.get(root.attrs.get("calls", "").lstrip("%"))
        inner_root = next((i for i in inner.instructions.values() if i.is_root), None) if inner else None
        if inner_root is None or inner_root.opcode != "compare":
            return None
        params = {inner.parameter(k).name: root.operands[k] for k in range(len(root.operands))
                  if inner.parameter(k) is not None}
        compare, args = inner_root, tuple(params.get(a, a) for a in inner_root.operands)
    if compare.opcode != "compare" or len(args) != 2:
        return None
    direction = compare.attrs.get("direction", "")
    lhs, rhs = (_scalar_constant(cond, a) for a in args)
    if rhs is not None and lhs is None:
        ivar, limit = args[0], rhs
    elif lhs is not None and rhs is None:
        ivar, limit = args[1], lhs
        direction = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}.get(direction, direction)
    else:
        return None
    init = _init_value(loop, caller, cond, ivar)
    if init is None:
        return None
    span = {"LT": limit - init, "LE": limit - init + 1, "GT": init - limit, "GE": init - limit + 1}.get(direction)
    return None if span is None else max(span, 0)


def _init_value(loop: Instruction, caller: Computation, cond: Computation, ivar: str) -> int | None:
    gte = cond.instructions.get(ivar)
    if gte is None or gte.opcode != "get-tuple-element":
        return None
    index = int(gte.attrs.get("index", "-1"))
    if m := re.search(r'"known_init_step":\{"init":"(-?\d+)","step":"1"\}', loop.attrs.get("backend_config", "")):
        return int(m.group(1))
    init_tuple = caller.instructions.get(loop.operands[0]) if loop.operands else None
    if init_tuple is None or init_tuple.opcode != "tuple" or not 0 <= index < len(init_tuple.operands):
        return None
    return _scalar_constant(caller, init_tuple.operands[index])


_CALL_ATTRS = ("calls", "to_apply", "true_computation", "false_computation",
               "branch_computations", "called_computations")


def _multipliers(module: HloModule) -> dict[str, int]:
    """How many times each computation runs per execution of the entry."""
    callers: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for comp in module.computations.values():
        for inst in comp.instructions.values():
            if inst.opcode in ("async-done", "async-update"):
                continue  # the async-start already accounts for its computation
            factor = 1
            keys: Iterable[str] = _CALL_ATTRS
            if inst.opcode == "while":
                trip = _trip_count(inst, comp, module)
                if trip is None:
                    log.warning("trip count of %s not found: its body is counted once", inst.name)
                factor, keys = (1 if trip is None else trip), ("body", "condition")
            if inst.opcode == "conditional":
                branches = [b for key in _CALL_ATTRS
                            for b in re.findall(r"%?([^\s{},%]+)", inst.attrs.get(key, ""))]
                priced = max(branches, key=lambda b: _computation_work(module, b), default=None)
                for b in branches:
                    callers[b].append((comp.name, int(b == priced)))
                continue
            for key in keys:
                for callee in re.findall(r"%?([^\s{},%]+)", inst.attrs.get(key, "")):
                    callers[callee].append((comp.name, factor))

    @functools.cache
    def times(name: str) -> int:
        if module.computations[name].is_entry or name not in callers:
            return 1
        return sum(times(caller) * factor for caller, factor in callers[name] if caller in module.computations)

    return {name: times(name) for name in module.computations}


def _computation_work(module: HloModule, name: str) -> tuple[float, float]:
    """(FLOPs, bytes) of a computation's instructions and of the computations they call, each once."""
    comp = module.computations.get(name)
    if comp is None:
        return 0.0, 0.0
    flops = nbytes = 0.0
    for inst in comp.instructions.values():
        flops += _instruction_flops(module, comp, inst)
        nbytes += xla_instruction_bytes(module, comp, inst)
        if inst.opcode == "fusion":
            continue  # _instruction_flops counted its fused computation
        for key in _CALL_ATTRS:
            for callee in re.findall(r"%?([^\s{},%]+)", inst.attrs.get(key, "")):
                f, b = _computation_work(module, callee)
                flops, nbytes = flops + f, nbytes + b
    return flops, nbytes


# ----------------------------------------------------------------------------- reduce-scatter


def _only_group_slices(module: HloModule, comp: Computation, name: str, elements: int, group: int) -> bool:
    """True when every use of ``name`` is a dynamic-slice keeping at most elements/group of it.

    A slice finer than 1/group is a reduce-scatter over the group followed by a local slice
    (a sum over one mesh axis landing in a layout split over more axes): the bytes that
    cross the links are the reduce-scatter's.
    """
    inst = comp.instructions[name]
    users = comp.users.get(name, [])
    if inst.is_root or not users:
        return False
    for user in users:
        if user.opcode in ("bitcast", "reshape", "copy"):
            ok = _only_group_slices(module, comp, user.name, elements, group)
        elif user.opcode == "dynamic-slice" and user.operands[0] == name:
            kept = sum(shape_elements(user.shape)) * group
            ok = kept <= elements and elements % kept == 0
        elif user.opcode == "fusion":
            fused = module.computations.get(user.attrs.get("calls", "").lstrip("%"))
            params = [fused.parameter(k) if fused else None for k, o in enumerate(user.operands) if o == name]
            ok = bool(params) and all(
                p is not None and _only_group_slices(module, fused, p.name, elements, group) for p in params
            )
        else:
            ok = False
        if not ok:
            return False
    return True


def _is_reduce_scatter(module: HloModule, comp: Computation, result: Instruction, group: int) -> bool:
    if group <= 1:
        return False
    leaves = shape_elements(result.shape)
    if not result.shape.startswith("("):
        return _only_group_slices(module, comp, result.name, leaves[0], group)
    users = comp.users.get(result.name, [])
    return bool(users) and not result.is_root and all(
        u.opcode == "get-tuple-element"
        and _only_group_slices(module, comp, u.name, leaves[int(u.attrs.get("index", "0"))], group)
        for u in users
    )


# ----------------------------------------------------------------------------- reading


def read_hlo_collectives(hlo_text: str) -> list[HloCollective]:
    """Every collective of an optimized HLO module, in text order, with bytes and counts."""
    module = parse_module(hlo_text)
    runs = _multipliers(module)
    found: list[HloCollective] = []
    for comp in module.computations.values():
        for inst in comp.instructions.values():
            base = inst.opcode.removesuffix("-start")
            if base not in HLO_COLLECTIVE_KINDS or inst.opcode.endswith("-done"):
                continue
            result = inst
            if inst.opcode.endswith("-start"):
                done = next((u for u in comp.users.get(inst.name, []) if u.opcode == f"{base}-done"), None)
                if done is None:
                    log.warning("%s has no %s-done: reading its own shape", inst.name, base)
                else:
                    result = done
            found.extend(_collectives(module, comp, inst, result, base, runs[comp.name]))
    return found


def _tuple_element_bytes(result: Instruction) -> list[int]:
    inner = result.shape.strip()[1:-1]
    return [shape_nbytes(part) for part in split_top_level(inner)]


def _collectives(module: HloModule, comp: Computation, inst: Instruction, result: Instruction,
                 kind: str, count: int) -> list[HloCollective]:
    """One collective, or for a combined (tuple) all-reduce, its reduce-scatter and all-reduce parts.

    XLA's all-reduce combiner merges independent all-reduces into one tuple; on CPU some of its
    elements may be reduce-scatters (only a group slice of them is used) and others plain sums.
    """
    single = _collective(module, comp, inst, result, kind, count)
    if kind != "all-reduce" or single.kind != "all-reduce" or not result.shape.startswith("(") or result.is_root:
        return [single]
    group = single.group_size
    users = comp.users.get(result.name, [])
    if group <= 1 or not users or any(u.opcode != "get-tuple-element" for u in users):
        return [single]
    sizes = _tuple_element_bytes(result)
    leaves = shape_elements(result.shape)
    scattered = [False] * len(sizes)
    for index in range(len(sizes)):
        readers = [u for u in users if int(u.attrs.get("index", "0")) == index]
        scattered[index] = bool(readers) and all(
            _only_group_slices(module, comp, u.name, leaves[index], group) for u in readers)
    rs = sum(b for b, sc in zip(sizes, scattered) if sc)
    ar = sum(b for b, sc in zip(sizes, scattered) if not sc)
    parts = []
    if rs:
        parts.append(dataclasses.replace(single, kind="reduce-scatter", nbytes=rs))
    if ar:
        parts.append(dataclasses.replace(single, nbytes=ar))
    return parts or [single]


def _collective(module: HloModule, comp: Computation, inst: Instruction, result: Instruction,
                kind: str, count: int) -> HloCollective:
    operand_bytes = sum(shape_nbytes(comp.instructions[o].shape) for o in inst.operands if o in comp.instructions)
    if kind == "collective-permute":
        pairs_text = inst.attrs.get("source_target_pairs", "")
        group, groups = permute_groups(pairs_text)
        members = tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs_text))
    else:
        members = replica_groups_of(inst.attrs.get("replica_groups", "{}"), module.num_devices)
        group, groups = (max(map(len, members)), len(members)) if members else (1, 1)
    nbytes = shape_nbytes(result.shape)
    if kind == "all-reduce" and _is_reduce_scatter(module, comp, result, group):
        kind = "reduce-scatter"
    elif kind == "reduce-scatter":
        nbytes = operand_bytes or nbytes * group
    elif result is inst and inst.opcode.endswith("-start") and kind != "all-reduce":
        # no done found: the start's tuple holds operands (and contexts) beside the result
        nbytes = operand_bytes if kind == "collective-permute" else nbytes - operand_bytes
    return HloCollective(kind=kind, nbytes=nbytes, group_size=group, num_groups=groups,  # type: ignore[arg-type]
                         count=count, text=inst.line, groups=members)


def collective_bytes_by_kind(collectives: Iterable[HloCollective]) -> dict[str, float]:
    """Σ nbytes × count per kind; every kind is a key, absent kinds are 0."""
    totals = {kind: 0.0 for kind in HLO_COLLECTIVE_KINDS}
    for c in collectives:
        totals[c.kind] += float(c.nbytes * c.count)
    return totals


# ----------------------------------------------------------------------------- loop bodies

_SIMPLE_FLOP_OPS = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "compare", "select", "negate", "abs",
    "and", "or", "xor", "not", "clamp", "remainder", "sign", "floor", "ceil", "round-nearest-even",
    "round-nearest-afz", "convert",
})


def _instruction_flops(module: HloModule, comp: Computation, inst: Instruction) -> float:
    """FLOPs of one instruction, as HloCostAnalysis counts them for the ops that matter (estimate)."""
    if inst.opcode == "fusion":
        inner = module.computations.get(inst.attrs.get("calls", "").lstrip("%"))
        return 0.0 if inner is None else sum(_instruction_flops(module, inner, i) for i in inner.instructions.values())
    out = sum(shape_elements(inst.shape))
    if inst.opcode == "dot":
        lhs = comp.instructions.get(inst.operands[0]) if inst.operands else None
        dims = [int(d) for d in re.findall(r"\d+", inst.attrs.get("lhs_contracting_dims", ""))]
        if lhs is None:
            return 0.0
        lhs_dims = [int(d) for d in re.findall(r"\d+", lhs.shape.split("{")[0].split("[", 1)[-1])]
        return 2.0 * out * math.prod(lhs_dims[d] for d in dims if d < len(lhs_dims))
    if inst.opcode == "reduce" and inst.operands:
        first = comp.instructions.get(inst.operands[0])
        return float(sum(shape_elements(first.shape))) if first is not None else 0.0
    return float(out) if inst.opcode in _SIMPLE_FLOP_OPS else 0.0


def loop_repeats(hlo_text: str) -> tuple[float, float]:
    """(FLOPs, bytes) that ``cost_analysis()`` leaves out: it counts a while body once, so each
    computation that runs m > 1 times per step (a loop body, or one called from it) adds m - 1 times
    its instructions, each priced as XLA prices it (``compiler/hlo_bytes.py``: a dynamic-slice of a stacked
    array reads one slice, a dynamic-update-slice writes one). Fused computations are counted through their
    fusion instruction."""
    module = parse_module(hlo_text)
    runs = _multipliers(module)
    fused = {i.attrs.get("calls", "").lstrip("%") for c in module.computations.values()
             for i in c.instructions.values() if i.opcode == "fusion"}
    flops = nbytes = 0.0
    for comp in module.computations.values():
        extra = runs.get(comp.name, 1) - 1
        if extra <= 0 or comp.name in fused:
            continue
        for inst in comp.instructions.values():
            flops += extra * _instruction_flops(module, comp, inst)
            nbytes += extra * xla_instruction_bytes(module, comp, inst)
    return flops, nbytes


def summarize_compiled(compiled: Any) -> CompiledSummary:
    """Collectives, memory, FLOPs and bytes accessed of ``jax.jit(f).lower(...).compile()``, loop
    bodies counted their trip count times."""
    text = compiled.as_text()
    collectives = tuple(read_hlo_collectives(text))
    memory = compiled.memory_analysis()
    if memory is None:
        raise ValueError("compiled.memory_analysis() returned None: this backend gives no buffer sizes")
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: a list of one dict
        cost = cost[0] if cost else None
    # XLA leaves out zero counters: a dict without 'flops' counted none.
    loop_flops, loop_bytes = loop_repeats(text)
    flops = None if cost is None else float(cost.get("flops", 0.0)) + loop_flops
    accessed = None if cost is None else float(cost.get("bytes accessed", 0.0)) + loop_bytes
    argument, output = int(memory.argument_size_in_bytes), int(memory.output_size_in_bytes)
    alias, temp = int(memory.alias_size_in_bytes), int(memory.temp_size_in_bytes)
    return CompiledSummary(
        collectives=collectives,
        bytes_by_kind=collective_bytes_by_kind(collectives),
        argument_bytes=argument, output_bytes=output, alias_bytes=alias, temp_bytes=temp,
        peak_bytes=argument + output - alias + temp,
        flops=flops, bytes_accessed=accessed,
    )
