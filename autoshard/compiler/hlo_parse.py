"""Parse the optimized HLO text of ``compiled.as_text()``: shapes, instructions, computations, groups.

The syntax half of ``compiler/hlo.py`` (checked on jax/jaxlib 0.10.2, XLA:CPU):

* Instructions look like ``%name = SHAPE opcode(%a, %b), attr=..., ...``;
  shapes may be tuples ``(f32[4,1,8]{2,1,0}, ...)``; a tuple result is the sum
  of its elements. Computations are blocks ``%name (params) -> shape {``.
* Replica groups come in several spellings (explicit, iota, empty, mesh-style);
  ``replica_groups_of`` reads them all (``group_size_of`` their sizes), ``permute_groups`` reads the rings of a
  ``collective-permute``'s ``source_target_pairs``.

Here: shape sizes (``shape_nbytes``, ``shape_elements``), the text scanner
(``_scan_balanced``, ``split_top_level``, ``_parse_attrs``), the parsed
module (``Instruction``, ``Computation``, ``HloModule``, ``parse_module``),
``opcode_counts`` and the group readers. What the instructions mean (collectives, loop trip counts,
reduce-scatter recognition, the compiled summary) is in ``compiler/hlo.py``,
which re-exports ``shape_nbytes`` and ``shape_elements``.
"""
from __future__ import annotations

import logging
import math
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- shapes

_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_FIXED_BITS = {"pred": 8, "token": 0}


def _dtype_bits(dtype: str) -> int:
    if dtype in _FIXED_BITS:
        return _FIXED_BITS[dtype]
    m = re.match(r"[a-z]+(\d+)", dtype)  # f32, bf16, s4, c64, f8e4m3fn, ...
    if m is None:
        raise ValueError(f"unknown HLO element type {dtype!r}: add it to _FIXED_BITS in {__name__}")
    return int(m.group(1))


def _array_dims(dims_text: str) -> list[int]:
    dims = []
    for d in filter(None, dims_text.split(",")):
        d = d.strip().removeprefix("<=")  # bounded dynamic dim: its bound
        dims.append(int(d) if d.isdigit() else 0)
    return dims


def shape_elements(shape_text: str) -> list[int]:
    """Element counts of the arrays in an HLO shape (one per tuple leaf)."""
    return [math.prod(_array_dims(dims)) for _, dims in _ARRAY_RE.findall(shape_text)]


def shape_nbytes(shape_text: str) -> int:
    """Bytes of an HLO shape such as ``f32[16,64]{1,0}`` or ``(bf16[2], s32[])``."""
    total_bits = 0
    for dtype, dims in _ARRAY_RE.findall(shape_text):
        total_bits += math.prod(_array_dims(dims)) * _dtype_bits(dtype)
    return (total_bits + 7) // 8


# ----------------------------------------------------------------------------- text

_OPEN, _CLOSE = "([{", ")]}"


def _scan_balanced(s: str, i: int) -> int:
    """Index just past the bracket group that opens at s[i] (quotes are skipped)."""
    depth = 0
    while i < len(s):
        c = s[i]
        if c == '"':
            i = s.index('"', i + 1) if '"' in s[i + 1:] else len(s)
        elif c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return len(s)


def split_top_level(s: str) -> list[str]:
    """Split on commas that are outside brackets and quotes."""
    items, depth, start, i = [], 0, 0, 0
    while i < len(s):
        c = s[i]
        if c == '"':
            j = s.find('"', i + 1)
            i = len(s) if j < 0 else j
        elif c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
        elif c == "," and depth == 0:
            items.append(s[start:i].strip())
            start = i + 1
        i += 1
    if s[start:].strip():
        items.append(s[start:].strip())
    return items


def _parse_attrs(text: str) -> dict[str, str]:
    attrs: dict[str, str] = {}
    for item in split_top_level(text):
        key, eq, value = item.partition("=")
        if not eq:
            continue
        if key == "device_ids" and attrs.get("replica_groups", "").startswith("mesh"):
            # mesh-style groups print as `mesh[..], device_ids=(..) {axes}`: one value
            attrs["replica_groups"] += f", device_ids={value}"
            continue
        attrs[key] = value
    return attrs


@dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: Mapping[str, str]
    line: str
    is_root: bool


@dataclass
class Computation:
    name: str
    is_entry: bool
    instructions: dict[str, Instruction] = field(default_factory=dict)
    users: dict[str, list[Instruction]] = field(default_factory=lambda: defaultdict(list))

    def parameter(self, index: int) -> Instruction | None:
        for inst in self.instructions.values():
            if inst.opcode == "parameter" and inst.operands == (str(index),):
                return inst
        return None


@dataclass(frozen=True)
class HloModule:
    computations: dict[str, Computation]
    num_devices: int


_INSTR_HEAD_RE = re.compile(r"(ROOT\s+)?%?([^\s=]+)\s*=\s*")
_COMP_HEAD_RE = re.compile(r"(ENTRY\s+)?%?([^\s(]+)\s*\(.*\)\s*->.*\{\s*$")
_OPCODE_RE = re.compile(r"\s*([\w\-]+)\(")


def _parse_instruction(line: str) -> Instruction | None:
    m = _INSTR_HEAD_RE.match(line)
    if m is None:
        return None
    i = m.end()
    if i < len(line) and line[i] == "(":
        j = _scan_balanced(line, i)
    else:
        j = line.find(" ", i)
        if j < 0:
            return None
    shape = line[i:j]
    op = _OPCODE_RE.match(line, j)
    if op is None:
        return None
    k = _scan_balanced(line, op.end() - 1)
    operands = tuple(
        tok.split()[-1].lstrip("%") for tok in split_top_level(line[op.end():k - 1]) if tok.split()
    )
    rest = line[k:].lstrip().removeprefix(",")
    return Instruction(
        name=m.group(2), shape=shape, opcode=op.group(1), operands=operands,
        attrs=_parse_attrs(rest), line=line, is_root=bool(m.group(1)),
    )


def parse_module(hlo_text: str) -> HloModule:
    computations: dict[str, Computation] = {}
    current: Computation | None = None
    num_partitions = replica_count = 1
    for raw in hlo_text.splitlines():
        line = raw.strip()
        if line.startswith("HloModule"):
            if m := re.search(r"num_partitions=(\d+)", line):
                num_partitions = int(m.group(1))
            if m := re.search(r"replica_count=(\d+)", line):
                replica_count = int(m.group(1))
            continue
        if current is None or not raw[:1].isspace():
            if m := _COMP_HEAD_RE.match(line):
                current = Computation(name=m.group(2), is_entry=bool(m.group(1)))
                computations[current.name] = current
                continue
        if line == "}":
            current = None
            continue
        if current is None or not line:
            continue
        inst = _parse_instruction(line)
        if inst is None:
            continue
        current.instructions[inst.name] = inst
        for operand in inst.operands:
            current.users[operand].append(inst)
    return HloModule(computations, num_devices=num_partitions * replica_count)


def opcode_counts(hlo_text: str) -> dict[str, int]:
    """How many instructions of each opcode the module holds, fused computations included: two programs
    with the same counts (and the same ``memory_analysis()``) are the same program for a comparison of
    what a wrapper adds (a convert, a copy, a constraint left in)."""
    counts: dict[str, int] = defaultdict(int)
    for comp in parse_module(hlo_text).computations.values():
        for inst in comp.instructions.values():
            counts[inst.opcode] += 1
    return dict(counts)


# ----------------------------------------------------------------------------- groups


def group_size_of(replica_groups_text: str, num_devices: int | None = None) -> tuple[int, int]:
    """(devices per group, number of groups) of an HLO ``replica_groups`` value (``replica_groups_of``)."""
    groups = replica_groups_of(replica_groups_text, num_devices)
    sizes = sorted({len(g) for g in groups})
    if len(sizes) > 1:
        log.warning("replica groups of unequal sizes %s: reporting the largest", sizes)
    return (sizes[-1], len(groups)) if groups else (1, 1)


def replica_groups_of(replica_groups_text: str, num_devices: int | None = None) -> tuple[tuple[int, ...], ...]:
    """The device groups of an HLO ``replica_groups`` value, each a tuple of device (partition) ids.

    Spellings: explicit ``{{0,4},{1,5},...}``; iota ``[2,4]<=[8]`` and transposed iota
    ``[4,2]<=[2,4]T(1,0)`` (``[groups, size]<=dims T(perm)``: ``iota(dims).transpose(perm)`` read row by row);
    empty ``{}`` meaning all ``num_devices``; mesh-style ``mesh['x'=2,'y'=4] {'y'}`` or ``mesh[...],
    device_ids=(...) {'y','x':(1)2}`` (a sub-axis ``'x':(m)k`` is the middle factor of x reshaped to
    (m, k, rest)); ``maximal_mesh`` (one device: no group).
    """
    text = replica_groups_text.strip().removeprefix("replica_groups=").strip()
    if text.startswith("maximal_mesh"):
        return ()
    if text.startswith("mesh"):
        return _mesh_groups(text)
    if m := re.fullmatch(r"\[(\d+),(\d+)\]<=\[([\d,]*)\](?:T\(([\d,]*)\))?", text):
        return _rows(_iota(m.group(3), m.group(4)).reshape(int(m.group(1)), int(m.group(2))))
    groups = re.findall(r"\{([^{}]*)\}", text[1:-1]) if text.startswith("{{") else []
    if groups:
        return tuple(tuple(int(t) for t in g.split(",") if t.strip()) for g in groups)
    if re.fullmatch(r"\{\s*\}", text):
        if num_devices is None:
            raise ValueError("replica_groups={} means all devices: pass num_devices")
        return (tuple(range(num_devices)),)
    raise ValueError(f"unrecognised replica_groups spelling {text!r}")


def _iota(dims_text: str, perm_text: str | None) -> np.ndarray:
    dims = [int(d) for d in dims_text.split(",") if d]
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose([int(p) for p in perm_text.split(",") if p]) if perm_text else ids


def _rows(ids: np.ndarray) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(d) for d in row) for row in ids)


def _mesh_groups(text: str) -> tuple[tuple[int, ...], ...]:
    head = text[: text.index("]")]
    axes = [(name, int(size)) for name, size in re.findall(r"'?([\w.\-]+)'?=(\d+)", head)]
    sizes = dict(axes)
    total = math.prod(sizes.values())
    ids = np.arange(total)
    if m := re.search(r"device_ids=\((.*)\)\s*\{", text):
        spelled = m.group(1).strip()
        if it := re.fullmatch(r"\[([\d,]*)\](?:T\(([\d,]*)\))?", spelled):
            ids = _iota(it.group(1), it.group(2)).reshape(-1)
        else:
            ids = np.asarray([int(t) for t in spelled.split(",") if t.strip()])
    refs = []
    for ref in filter(None, (a.strip() for a in text[text.rindex("{") + 1: text.rindex("}")].split(","))):
        m = re.fullmatch(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", ref)
        if m is None or m.group(1) not in sizes:
            raise ValueError(f"unrecognised mesh axis {ref!r} in replica_groups {text!r}")
        name, size = m.group(1), sizes[m.group(1)]
        refs.append((name, int(m.group(2)), int(m.group(3))) if m.group(3) else (name, 1, size))
    # split each axis at its referenced sub-axes' edges (major to minor), then gather the referenced factors
    cuts: dict[str, set[int]] = {name: {1, size} for name, size in axes}
    for name, pre, size in refs:
        cuts[name] |= {pre, pre * size}
    factors: list[tuple[str, int, int]] = []  # (axis, pre-size, size) of each factor, major to minor
    for name, size in axes:
        edges = sorted(cuts[name])
        factors += [(name, lo, hi // lo) for lo, hi in zip(edges, edges[1:])]
    grid = ids.reshape([f[2] for f in factors] or [1])
    chosen = [i for name, pre, size in refs for i, (axis, lo, n) in enumerate(factors)
              if axis == name and pre <= lo and lo * n <= pre * size]
    rest = [i for i in range(len(factors)) if i not in chosen]
    group = math.prod(factors[i][2] for i in chosen)
    return _rows(grid.transpose(rest + chosen).reshape(-1, group))


def permute_groups(pairs_text: str) -> tuple[int, int]:
    """(devices per ring, rings) of ``source_target_pairs``: its connected components."""
    parent: dict[int, int] = {}

    def find(a: int) -> int:
        while parent.setdefault(a, a) != a:
            a = parent[a]
        return a

    for src, dst in re.findall(r"\{(\d+),(\d+)\}", pairs_text):
        parent[find(int(src))] = find(int(dst))
    if not parent:
        return 1, 0
    sizes: dict[int, int] = defaultdict(int)
    for node in list(parent):
        sizes[find(node)] += 1
    return max(sizes.values()), len(sizes)
