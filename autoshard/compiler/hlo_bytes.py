"""Bytes accessed per HLO instruction, counted the way XLA's ``HloCostAnalysis`` counts them.

``compiled.cost_analysis()["bytes accessed"]`` counts a while body once (``compiler/hlo.py``
adds the other trip-count - 1 runs), so the reader must price a body's instructions exactly as
XLA does, or the loop's share is wrong. A plain "operands plus result" overcounts a scan's body
badly: each iteration's dynamic-slice of a stacked array and dynamic-update-slice into it touch
one layer, not the whole stack. XLA's rules, reproduced here:

- ``dynamic-slice``, ``slice``, ``gather``: the result read and written (plus the indices);
  ``dynamic-update-slice``: the update read and written (the operand aliases the result);
- a fusion reads each of its parameters once (``_parameter_read_bytes``): a parameter that
  only feeds a (dynamic-)slice as its sliced operand reads the slice; one that is the operand
  a dynamic-update-slice writes into in place reads nothing; a broadcast or reshape user reads
  it whole (each); any other users share one whole read;
- a fusion writes each output array whole, except one whose root (or tuple element) is a
  dynamic-update-slice: that writes the update;
- a while, call or conditional moves nothing of its own (the computations it runs are counted);
- parameters, constants, tuples, get-tuple-elements and bitcasts move nothing; any other
  instruction reads its operands and writes its result.
"""
from __future__ import annotations

from autoshard.compiler.hlo_parse import Computation, HloModule, Instruction, shape_nbytes

_NO_BYTES = frozenset({"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all",
                       "partition-id", "replica-id"})
_CALLERS = frozenset({"while", "call", "conditional"})  # XLA counts the computations they run, not their tuples
_SLICES = frozenset({"slice", "dynamic-slice", "gather"})


def _operand_bytes(comp: Computation, name: str) -> int:
    inst = comp.instructions.get(name)
    return 0 if inst is None else shape_nbytes(inst.shape)


def _parameter_read_bytes(fused: Computation, param: Instruction) -> int:
    """What a fusion reads of one of its parameters (module docstring; XLA's FusionParameterReadBytes)."""
    whole = shape_nbytes(param.shape)
    size, shared = 0, False
    for user in fused.users.get(param.name, ()):
        sliced_operand = bool(user.operands) and user.operands[0] == param.name
        if user.opcode in ("slice",) or (user.opcode == "dynamic-slice" and sliced_operand):
            size += shape_nbytes(user.shape)
        elif user.opcode == "dynamic-update-slice" and sliced_operand:
            continue  # written in place: the result aliases it
        elif user.opcode in ("broadcast", "reshape"):
            size += whole
        elif not shared:
            shared = True
            size += whole
    return size


def _fusion_output_bytes(fused: Computation, fusion: Instruction) -> int:
    root = next((i for i in fused.instructions.values() if i.is_root), None)
    if root is None:
        return shape_nbytes(fusion.shape)
    outputs = [fused.instructions.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
    total = 0
    for out in outputs:
        if out is None:
            continue
        if out.opcode == "dynamic-update-slice" and len(out.operands) > 1:
            total += _operand_bytes(fused, out.operands[1])
        else:
            total += shape_nbytes(out.shape)
    return total


def xla_instruction_bytes(module: HloModule, comp: Computation, inst: Instruction) -> float:
    """Bytes accessed of one instruction of a non-fused computation, as ``HloCostAnalysis`` counts them."""
    op = inst.opcode
    if op in _NO_BYTES or op in _CALLERS:
        return 0.0
    if op in _SLICES:
        indices = sum(_operand_bytes(comp, o) for o in inst.operands[1:])
        return float(2 * shape_nbytes(inst.shape) + indices)
    if op == "dynamic-update-slice" and len(inst.operands) > 1:
        update = _operand_bytes(comp, inst.operands[1])
        return float(2 * update + sum(_operand_bytes(comp, o) for o in inst.operands[2:]))
    if op == "fusion":
        fused = module.computations.get(inst.attrs.get("calls", "").lstrip("%"))
        if fused is not None:
            params = [i for i in fused.instructions.values() if i.opcode == "parameter"]
            return float(_fusion_output_bytes(fused, inst) + sum(_parameter_read_bytes(fused, p) for p in params))
    return float(shape_nbytes(inst.shape) + sum(_operand_bytes(comp, o) for o in inst.operands))
