"""Megatron tensor parallelism read off the graph: which kernels are column- and which row-parallel.

A kernel's forward contraction (its first ``dot_general``, or ``conv`` as the
rhs) is *column* when its output, through reshapes and a bias add, feeds a
nonlinearity (GELU, ReLU, softmax) or an activation x activation contraction
(attention scores, attention values); a kernel is *row* when every parameter
contraction its input comes from (walking back through any op) is column,
and no path reaches the batch. Kernels are taken in program order, so a chain
of dense layers alternates column, row, column... Only column kernels that
some row kernel reads are kept (the Megatron pairs): the LM head and an MoE
router stay out. A column kernel's bias (added right after it) is split with
it.

When the graph shows no pair (a scanned model, say), conventional parameter
names decide: q/k/v/query/key/value/up/gate/fc1/wi/w1/c_fc/c_attn/w_in are
column, out/o/down/fc2/wo/w2/c_proj/proj/w_out are row.
``MegatronRoles.source`` says which way they were found.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from autoshard.ir.graph import Op, OpGraph, Role, ValueId
from autoshard.ir.primitives import CONTRACTIONS, Values, facts, primitives

# views of a parameter: its values reshaped, transposed, copied, cast or broadcast
_TRANSPARENT = primitives(lambda f: f.values in (Values.REARRANGED, Values.COPY, Values.CAST, Values.BROADCAST))
_MIXING = primitives(lambda f: f.activation)
_COLUMN_NAMES = re.compile(
    r"^(q|k|v|query|key|value|qkv|up|gate|fc1|wi|wi_0|wi_1|w1|w3|c_fc|c_attn|w_in|dense_h_to_4h)$")
_ROW_NAMES = re.compile(r"^(out|o|down|fc2|wo|w2|c_proj|proj|out_proj|o_proj|w_out|dense_4h_to_h|dense)$")
_BFS_LIMIT = 2000


@dataclass(frozen=True)
class MegatronRoles:
    """Flat input index -> the dimension Megatron splits: column and row kernels, column biases."""

    column: Mapping[int, int]
    row: Mapping[int, int]
    bias: Mapping[int, int]
    source: Literal["graph", "names", "none"]

    def __str__(self) -> str:
        return f"{len(self.column)} column, {len(self.row)} row kernels (from {self.source})"


class _GraphIndex:
    def __init__(self, graph: OpGraph) -> None:
        self.graph = graph
        self.producer: dict[ValueId, Op] = graph.producers()
        self.consumers = graph.consumers()
        self.input_index = {v: i for i, v in enumerate(graph.inputs)}

    def param_origin(self, vid: ValueId) -> int | None:
        """The flat index of the parameter ``vid`` is a reshaped/converted/broadcast view of, if any."""
        for _ in range(16):
            if vid in self.input_index:
                i = self.input_index[vid]
                return i if self.graph.values[vid].role == Role.PARAM else None
            op = self.producer.get(vid)
            if op is None or op.primitive not in _TRANSPARENT:
                return None
            live = [v for v in op.inputs if self.graph.values[v].role != Role.CONSTANT]
            if len(live) != 1:
                return None
            vid = live[0]
        return None


def _forward_dots(ix: _GraphIndex) -> dict[int, tuple[Op, int]]:
    """Parameter (flat index) -> (its first dot_general/conv, the operand position it sits at)."""
    found: dict[int, tuple[Op, int]] = {}
    for op in ix.graph.ops:
        if op.primitive not in CONTRACTIONS:
            continue
        origins = [ix.param_origin(v) for v in op.inputs]
        params = [(pos, p) for pos, p in enumerate(origins) if p is not None]
        if len(params) != 1:
            continue
        pos, p = params[0]
        value = ix.graph.values[ix.graph.inputs[p]]
        if op.primitive == "conv_general_dilated" and pos != 1:
            continue
        if p not in found and value.rank >= 2 and ix.graph.values[op.inputs[pos]].shape == value.shape:
            found[p] = (op, pos)
    return found


def _feeds_mixing(ix: _GraphIndex, dot: Op) -> tuple[bool, list[int]]:
    """Does the dot's output, through views and a bias add, reach a nonlinearity or an activation dot?"""
    frontier, seen, biases, mixing = list(dot.outputs), set(dot.outputs), [], False
    while frontier:
        vid = frontier.pop()
        for op in ix.consumers.get(vid, []):
            others = [v for v in op.inputs if v != vid and ix.graph.values[v].role != Role.CONSTANT]
            if op.primitive in CONTRACTIONS:
                mixing |= all(ix.param_origin(v) is None for v in op.inputs)
                continue
            if op.primitive in _MIXING:
                mixing = True
                continue
            through = op.primitive in _TRANSPARENT
            if facts(op.primitive).additive and len(others) == 1:
                bias = ix.param_origin(others[0])
                if bias is not None:
                    biases.append(bias)
                    through = True
            if through:
                for out in op.outputs:
                    if out not in seen:
                        seen.add(out)
                        frontier.append(out)
    return mixing, biases


def _dot_sources(ix: _GraphIndex, start: ValueId, dot_of: Mapping[int, int]) -> set[int] | None:
    """Parameters whose forward dots the value ``start`` comes from; None if a path reaches the batch."""
    found: set[int] = set()
    frontier, seen = [start], {start}
    while frontier:
        if len(seen) > _BFS_LIMIT:
            return None
        vid = frontier.pop()
        if vid in ix.input_index:
            if ix.graph.values[vid].role == Role.BATCH:
                return None
            continue
        op = ix.producer.get(vid)
        if op is None:
            continue
        if op.id in dot_of:
            found.add(dot_of[op.id])
            continue
        for v in op.inputs:
            if v not in seen and ix.graph.values[v].role != Role.CONSTANT:
                seen.add(v)
                frontier.append(v)
    return found


def _split_dims(op: Op, pos: int, rank: int) -> tuple[int, int]:
    """(output-feature dim, contracting dim) of the parameter operand of ``op``; -1 where there is none."""
    if op.primitive == "conv_general_dilated":
        out_dim, in_dim = op.params["dimension_numbers"].rhs_spec[:2]
        return (out_dim, in_dim) if op.params["feature_group_count"] == 1 else (-1, -1)
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    contract, batch = (lc, lb) if pos == 0 else (rc, rb)
    free = [d for d in range(rank) if d not in contract and d not in batch]
    return (free[-1] if free else -1), (contract[0] if contract else -1)


def megatron_roles(graph: OpGraph) -> MegatronRoles:
    """Column and row kernels of the Megatron pairs (see the module docstring), from the graph or names.

    Kernels are taken in the order of their forward contractions: one is row when every
    contraction its input comes from is column; otherwise it is column when its output feeds a
    nonlinearity or an activation contraction. A chain of layers alternates column, row, column...
    """
    ix = _GraphIndex(graph)
    dots = _forward_dots(ix)
    dot_of = {op.id: p for p, (op, _pos) in dots.items()}
    rank = {p: graph.values[graph.inputs[p]].rank for p in dots}
    column: dict[int, int] = {}
    row: dict[int, int] = {}
    partners: set[int] = set()
    biases: dict[int, list[int]] = {}
    for p, (op, pos) in sorted(dots.items(), key=lambda item: item[1][0].id):
        out_dim, in_dim = _split_dims(op, pos, rank[p])
        sources = _dot_sources(ix, op.inputs[1 - pos] if op.primitive == "dot_general" else op.inputs[0], dot_of)
        if sources and all(s in column for s in sources) and in_dim >= 0:
            row[p] = in_dim
            partners |= sources
            continue
        mixing, found = _feeds_mixing(ix, op)
        if mixing and out_dim >= 0:
            column[p] = out_dim
            biases[p] = found
    column = {p: d for p, d in column.items() if p in partners}
    if column and row:
        bias = {}
        for p, d in column.items():
            size = graph.values[graph.inputs[p]].shape[d]
            for b in biases[p]:
                shape = graph.values[graph.inputs[b]].shape
                if shape and shape[-1] == size:
                    bias[b] = len(shape) - 1
        return MegatronRoles(column, row, bias, "graph")
    return roles_from_names(graph)


_KEY = re.compile(r"\['([^']*)'\]|\.(\w+)|\[(\d+)\]")


def _keys(path: str | None) -> list[str]:
    """The keys of a pytree path: ``[0]['blocks'][3]['q']['kernel']`` -> 0, blocks, 3, q, kernel."""
    return [a or b or c for a, b, c in _KEY.findall(path or "")]


def roles_from_names(graph: OpGraph) -> MegatronRoles:
    column: dict[int, int] = {}
    row: dict[int, int] = {}
    bias: dict[int, int] = {}
    params = [(i, graph.values[v]) for i, v in enumerate(graph.inputs) if graph.values[v].role == Role.PARAM]
    kernels: dict[str, tuple[int, int]] = {}
    for i, value in params:
        keys = _keys(value.path)
        if len(keys) < 2 or value.rank < 2:
            continue
        module, leaf = (keys[-2], keys[-1]) if keys[-1] in ("kernel", "weight", "w") else (keys[-1], keys[-1])
        prefix = (value.path or "").rsplit("[", 1)[0]
        if _COLUMN_NAMES.match(module.lower()):
            column[i] = value.rank - 1
            kernels[prefix] = (i, value.shape[-1])
        elif _ROW_NAMES.match(module.lower()):
            row[i] = value.rank - 2
    for i, value in params:
        prefix = (value.path or "").rsplit("[", 1)[0]
        if _keys(value.path)[-1:] == ["bias"] and prefix in kernels and value.shape[-1:] == (kernels[prefix][1],):
            bias[i] = value.rank - 1
    if not (column and row):
        return MegatronRoles({}, {}, {}, "none")
    return MegatronRoles(column, row, bias, "names")
