"""Parse the optimized HLO text of ``compiled.as_text()``: shapes, instructions, computations, groups.

The syntax half of ``compiler/hlo.py`` (checked on jax/jaxlib 0.10.2, XLA:CPU):

* Instructions look like ``%name = SHAPE opcode(%a, %b), attr=..., ...``;
  shapes may be tuples ``(f32[4,1,8]{2,1,0}, ...)``; a tuple result is the sum
  of its elements. Computations are blocks ``%name (params) -> shape {``.
* Replica groups come in several spellings (explicit, iota, empty, mesh-style);
  ``group_size_of`` reads them all, ``permute_groups`` reads the rings of a
  ``collective-permute``'s ``source_target_pairs``.

Here: shape sizes (``shape_nbytes``, ``shape_elements``), the text scanner
(``_scan_balanced``, ``split_top_level``, ``_parse_attrs``), the parsed
module (``Instruction``, ``Computation``, ``HloModule``, ``parse_module``) and
the group readers. What the instructions mean (collectives, loop trip counts,
reduce-scatter recognition, the compiled summary) is in ``compiler/hlo.py``,
which re-exports ``shape_nbytes``, ``shape_elements`` and ``group_size_of``.
"""
from __future__ import annotations

import logging
import math
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

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


# ----------------------------------------------------------------------------- groups


def group_size_of(replica_groups_text: str, num_devices: int | None = None) -> tuple[int, int]:
    """(devices per group, number of groups) of an HLO ``replica_groups`` value.

    Spellings: explicit ``{{0,4},{1,5},...}``; iota ``[2,4]<=[8]`` and
    transposed iota ``[4,2]<=[2,4]T(1,0)`` (``[groups, size]<=...``); empty
    ``{}`` meaning all ``num_devices``; mesh-style
    ``mesh['x'=2,'y'=4] {'y'}`` or ``mesh[...], device_ids=(...) {'y','x':(1)2}``.
    """
    text = replica_groups_text.strip().removeprefix("replica_groups=").strip()
    if text.startswith("maximal_mesh"):
        return 1, 1
    if text.startswith("mesh"):
        return _mesh_group_size(text)
    if m := re.fullmatch(r"\[(\d+),(\d+)\]<=\[[\d,]*\](T\([\d,]*\))?", text):
        return int(m.group(2)), int(m.group(1))
    groups = re.findall(r"\{([^{}]*)\}", text[1:-1]) if text.startswith("{{") else []
    if groups:
        sizes = [len([t for t in g.split(",") if t.strip()]) for g in groups]
        if len(set(sizes)) > 1:
            log.warning("replica groups of unequal sizes %s: reporting the largest", sizes)
        return max(sizes), len(groups)
    if re.fullmatch(r"\{\s*\}", text):
        if num_devices is None:
            raise ValueError("replica_groups={} means all devices: pass num_devices")
        return num_devices, 1
    raise ValueError(f"unrecognised replica_groups spelling {text!r}")


def _mesh_group_size(text: str) -> tuple[int, int]:
    mesh_axes = dict(
        (name, int(size)) for name, size in re.findall(r"'?([\w.\-]+)'?=(\d+)", text[: text.index("]")])
    )
    axes_text = text[text.rindex("{") + 1: text.rindex("}")]
    size = 1
    for ref in filter(None, (a.strip() for a in axes_text.split(","))):
        m = re.fullmatch(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", ref)
        if m is None or m.group(1) not in mesh_axes:
            raise ValueError(f"unrecognised mesh axis {ref!r} in replica_groups {text!r}")
        size *= int(m.group(3)) if m.group(3) else mesh_axes[m.group(1)]
    total = math.prod(mesh_axes.values())
    return size, total // size


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
