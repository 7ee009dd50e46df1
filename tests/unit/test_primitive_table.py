"""The primitive table (``ir/primitives.py``) is the one list of what passes know about primitives.

Every strategy rule has a row whose family is the rule's (an elementwise rule on a primitive the table calls
a reduction fails here), every row of a planned family has its rule, calls are inlined and never planned, and
no module of the package keeps a second list of elementwise, reduction or shape primitives: each such set
is derived from the table.
"""
from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

from autoshard.ir.flops import op_flops
from autoshard.ir.graph import Op, Role, Value
from autoshard.ir.primitives import (CALLS, INLINED_CALLS, Family, FlopRule, OpKind, Values, facts, primitives,
                                     table)
from autoshard.ir.scan_stack import ROWWISE
from autoshard.ir.trace import INLINED
from autoshard.meshes.cluster import get_cluster
from autoshard.meshes.logical import make_logical_mesh
from autoshard.passes.liveness import op_kind
from autoshard.passes.strategies import REPLICATED, RULES, UnsupportedPrimitiveWarning, strategies_for
from autoshard.passes.strategies.elementwise import pointwise_rule

PACKAGE = Path(__file__).resolve().parents[2] / "autoshard"
# strategy rule module -> the families its rules may serve
RULE_FAMILIES = {
    "elementwise": {Family.ELEMENTWISE}, "dot": {Family.CONTRACTION}, "reduce": {Family.REDUCTION},
    "shape": {Family.SHAPE}, "indexing": {Family.INDEXING},
    "control": {Family.IDENTITY, Family.CONTROL, Family.RANDOM, Family.OTHER},
}
# the elementwise-rule primitives the memory model once treated as opaque (issue 26)
ONCE_OPAQUE = ("conj", "complex", "mulhi", "zeta", "igamma", "igammac", "igamma_grad_a", "polygamma",
               "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta")
# modules that name other things than jax primitives: HLO opcodes (add, slice, gather, ...) in the HLO readers
NOT_PRIMITIVES = {"compiler/hlo.py", "compiler/hlo_bytes.py"}


def test_every_rule_has_a_row_of_its_family() -> None:
    missing = sorted(name for name in RULES if name not in table())
    assert not missing, f"primitives with a strategy rule but no row in ir/primitives.py: {missing}"
    wrong = []
    for name, rule in RULES.items():
        family = facts(name).family
        allowed = {Family.ELEMENTWISE} if rule is pointwise_rule else RULE_FAMILIES[rule.__module__.rsplit(".", 1)[1]]
        if family not in allowed:
            wrong.append(f"{name}: rule {rule.__module__}.{rule.__name__}, row {family.name}")
    assert not wrong, f"rows that contradict their primitive's strategy rule: {wrong}"
    assert {n for n in RULES if RULES[n] is pointwise_rule} | {"bitcast_convert_type"} == primitives(
        lambda f: f.family is Family.ELEMENTWISE)


def test_every_row_is_planned_inlined_or_opaque() -> None:
    for name, row in table().items():
        if row.family in (Family.CALL, Family.AD_CALL):
            assert name not in RULES and name not in REPLICATED, name  # inlined by the tracer, never planned
        else:
            assert name in RULES, f"{name} has a row ({row.family.name}) but no strategy rule"
    declared = sorted(name for name in REPLICATED if name in table())
    assert not declared, f"primitives declared replicated answer UNKNOWN (opaque), yet have rows: {declared}"
    assert facts("cholesky") == facts("no such primitive") and facts("psum").kind is OpKind.OPAQUE
    assert INLINED == INLINED_CALLS and CALLS < INLINED_CALLS and "custom_vjp_call" in INLINED - CALLS


def test_rows_hold_together() -> None:
    for name, row in table().items():
        if row.family is Family.ELEMENTWISE:
            assert row.kind in (OpKind.ELEMENTWISE, OpKind.VIEW) and not row.own_layout, name
            assert row.flops in (FlopRule.PER_OUTPUT, FlopRule.ZERO, FlopRule.POLYNOMIAL), name
        if row.family is Family.CONTRACTION:
            assert row.kind is OpKind.OPAQUE and row.own_layout and row.flops in (FlopRule.DOT, FlopRule.CONV)
        if row.kind is OpKind.REDUCTION:
            assert row.family is Family.REDUCTION and row.flops is FlopRule.PER_INPUT, name
        if row.kind is OpKind.VIEW:  # a bitcast shares its operand's buffer: the values must survive it
            assert row.values is not Values.NEW or name == "loop_slice", name
        if row.order is not None or row.additive:
            assert row.family is Family.ELEMENTWISE, name
        if row.activation:
            assert row.family in (Family.ELEMENTWISE, Family.REDUCTION), name
    assert primitives(lambda f: f.order is not None) == {"lt", "le", "gt", "ge"}


def _mesh():
    return make_logical_mesh(get_cluster("cpu-8"), (2, 4))


@pytest.mark.parametrize("name", sorted(primitives(lambda f: f.family is Family.ELEMENTWISE)))
def test_an_elementwise_row_is_planned_and_priced_as_one(name: str) -> None:
    """Its rule runs it shard by shard (every operand in the output's layout, no collective), the memory model
    fuses or aliases it, the layer-stack splitter applies it row by row, its FLOPs count its output."""
    ins = [Value(0, (8, 16), "float32", Role.ACTIVATION), Value(1, (8, 16), "float32", Role.ACTIVATION)]
    out = Value(2, (8, 16), "float32", Role.ACTIVATION)
    if name == "bitcast_convert_type":
        ins = ins[:1]
    op = Op(0, name, {}, tuple(v.id for v in ins), (out.id,), 0.0, 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedPrimitiveWarning)
        found = strategies_for(op, ins, [out], _mesh())
    assert len(found) > 1
    for s in found:
        assert all(spec == s.out_specs[0] for spec in s.in_specs) and not s.collectives, (name, str(s))
    assert op_kind(op) in (OpKind.ELEMENTWISE, OpKind.VIEW) and facts(name).fusible and name in ROWWISE
    assert op_flops(name, {}, [(8, 16)] * 3, [(8, 16)]) in (0.0, 128.0 * facts(name).flops_per_element, 2 * 128.0)


def test_the_once_opaque_elementwise_primitives_are_elementwise_everywhere() -> None:
    for name in ONCE_OPAQUE:
        assert facts(name).kind is OpKind.ELEMENTWISE and facts(name).fusible and name in ROWWISE, name


def _names_in_literal(node: ast.AST) -> list[str]:
    if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
        elements = node.elts
    elif isinstance(node, ast.Dict):
        elements = [k for k in node.keys if k is not None]
    else:
        return []
    return [e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def test_no_module_keeps_a_second_list_of_elementwise_reduction_or_shape_primitives() -> None:
    """Any literal collection in the package naming two or more elementwise, reduction or shape primitives,
    outside the table and the strategy registry it is checked against (above), is a second list."""
    listed = primitives(lambda f: f.family in (Family.ELEMENTWISE, Family.REDUCTION, Family.SHAPE))
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where == "ir/primitives.py" or where.startswith("passes/strategies/") or where in NOT_PRIMITIVES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [n for n in _names_in_literal(node) if n in listed]
            if len(names) >= 2:
                found.append(f"autoshard/{where}:{node.lineno}: {names[:6]}")
    assert not found, f"lists of primitives outside ir/primitives.py (derive them from the table): {found}"
