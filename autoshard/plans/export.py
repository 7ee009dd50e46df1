"""Export a plan's parameter layouts for Flax: PartitionSpecs per path and logical-axis rules.

``autoshard export plan.json --format flax-rules`` writes JSON (``--python``:
an importable module with the same data). The format, version 1::

    {"format": "autoshard-flax-rules", "version": 1,
     "mesh": {"shape": [2, 4], "axis_names": ["x", "y"]},
     "params":       {PATH: [ENTRY, ...]},     # one PartitionSpec entry per dim
     "opt_state":    {PATH: [ENTRY, ...]},     # the optimizer state, same form
     "logical_axes": {PATH: [NAME, ...]},      # a logical axis name per parameter dim
     "rules":        [[NAME, ENTRY], ...]}     # logical name -> mesh axes (flax logical_axis_rules)

An ENTRY is ``null`` (replicated), a mesh axis name, or a list of names (a
dimension split over several axes, major first): ``PartitionSpec(*entries)``
after turning lists into tuples. A PATH is ``jax.tree_util.keystr`` of the
leaf *inside* its argument (``['blocks'][0]['attn']['q']['kernel']``), so::

    specs = {k: PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in v))
             for k, v in data["params"].items()}
    shardings = jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, specs[jax.tree_util.keystr(p)]), params)

works for any params pytree (Flax linen's ``variables``, or ``nnx.to_pure_dict``
of an NNX model's state). For logical-axis code, a logical name is the
parameter's path with layer numbers blanked plus the dimension
(``blocks.#.attn.q.kernel/1``); repeated layers that share a layout share
their names, so the rules stay as short as the model's distinct layers::

    logical = jax.tree_util.tree_map_with_path(
        lambda p, x: PartitionSpec(*data["logical_axes"][jax.tree_util.keystr(p)]), params)
    shardings = flax.linen.logical_to_mesh_sharding(logical, mesh, data["rules"])

(``nn.with_logical_partitioning(init, names)`` with these names, under
``nn.logical_axis_rules(rules)``, gives the same layouts at init time.)
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from autoshard.plans.plan import Plan
from autoshard.ir.spec import Spec

FORMAT = "autoshard-flax-rules"
VERSION = 1
Entry = None | str | list[str]


def _entry(axes: tuple[str, ...]) -> Entry:
    return None if not axes else axes[0] if len(axes) == 1 else list(axes)


def _inner_path(path: str) -> tuple[int, str]:
    """("[0]['blocks'][0]['kernel']") -> (0, "['blocks'][0]['kernel']"): argument index, path inside it."""
    match = re.match(r"^\[(\d+)\](.*)$", path)
    return (int(match.group(1)), match.group(2)) if match else (-1, path)


def _logical_key(inner: str, *, blank_layers: bool = True) -> str:
    """``['blocks'][3]['attn']['q']['kernel']`` -> ``blocks.#.attn.q.kernel`` (``blocks.3...`` unblanked)."""
    keys = [a or b or c for a, b, c in re.findall(r"\['([^']*)'\]|\.(\w+)|\[(\d+)\]", inner)]
    return ".".join("#" if blank_layers and k.isdigit() else k for k in keys) or "leaf"


def flax_rules(plan: Plan) -> dict[str, Any]:
    """The plan's parameter and optimizer-state layouts in the export format (module docstring)."""
    params: dict[str, list[Entry]] = {}
    opt_state: dict[str, list[Entry]] = {}
    layouts: dict[str, tuple[str, Spec]] = {}
    for path, spec in plan.input_specs.items():
        role = plan.input_roles.get(path, "")
        _arg, inner = _inner_path(path)
        if role == "param":
            params[inner] = [_entry(d) for d in spec.dims]
            layouts[inner] = (_logical_key(inner), spec)
        elif role == "opt_state":
            opt_state[inner] = [_entry(d) for d in spec.dims]
    # one logical name per (layer-free path, dim) when every layer agrees on the layout, else per path
    agreed: dict[tuple[str, int], set[tuple[str, ...]]] = {}
    for key, spec in layouts.values():
        for d, axes in enumerate(spec.dims):
            agreed.setdefault((key, d), set()).add(axes)
    logical: dict[str, list[str]] = {}
    rules: dict[str, Entry] = {}
    for inner, (key, spec) in layouts.items():
        names = []
        for d, axes in enumerate(spec.dims):
            own = key if len(agreed[(key, d)]) == 1 else _logical_key(inner, blank_layers=False)
            name = f"{own}/{d}"
            names.append(name)
            rules[name] = _entry(axes)
        logical[inner] = names
    return {
        "format": FORMAT, "version": VERSION,
        "mesh": {"shape": list(plan.mesh_shape), "axis_names": list(plan.axis_names)},
        "params": params, "opt_state": opt_state, "logical_axes": logical,
        "rules": [[name, entry] for name, entry in rules.items()],
    }


def _py(entry: Entry) -> str:
    if entry is None:
        return "None"
    if isinstance(entry, str):
        return repr(entry)
    return "(" + ", ".join(map(repr, entry)) + ("," if len(entry) == 1 else "") + ")"


def _specs_py(name: str, specs: Mapping[str, list[Entry]]) -> list[str]:
    lines = [f"{name} = {{"]
    lines += [f"    {path!r}: P({', '.join(_py(e) for e in entries)})," for path, entries in specs.items()]
    return lines + ["}"]


def flax_rules_python(data: Mapping[str, Any]) -> str:
    """The export as an importable Python module (``PARAM_SPECS``, ``LOGICAL_AXES``, ``RULES``, helpers)."""
    lines = [
        f'"""Parameter layouts exported by autoshard ({FORMAT} v{VERSION}); see autoshard.plans.export."""',
        "import jax",
        "from jax.sharding import NamedSharding, PartitionSpec as P",
        "",
        f"MESH_SHAPE = {tuple(data['mesh']['shape'])!r}",
        f"MESH_AXES = {tuple(data['mesh']['axis_names'])!r}",
        *_specs_py("PARAM_SPECS", data["params"]),
        *_specs_py("OPT_STATE_SPECS", data["opt_state"]),
        "LOGICAL_AXES = {",
        *[f"    {path!r}: {tuple(names)!r}," for path, names in data["logical_axes"].items()],
        "}",
        "RULES = (",
        *[f"    ({name!r}, {_py(entry)})," for name, entry in data["rules"]],
        ")",
        "",
        "",
        "def param_shardings(params, mesh):",
        '    """NamedShardings for a params pytree laid out like the planned one."""',
        "    return jax.tree_util.tree_map_with_path(",
        "        lambda p, x: NamedSharding(mesh, PARAM_SPECS[jax.tree_util.keystr(p)]), params)",
        "",
        "",
        "def logical_specs(params):",
        '    """PartitionSpecs of logical axis names, for flax.linen.logical_to_mesh_sharding(..., RULES)."""',
        "    return jax.tree_util.tree_map_with_path(lambda p, x: P(*LOGICAL_AXES[jax.tree_util.keystr(p)]), params)",
        "",
    ]
    return "\n".join(lines)


def dumps(data: Mapping[str, Any]) -> str:
    """JSON with one line per parameter path and per rule."""
    parts = []
    for key, value in data.items():
        if isinstance(value, dict) and value and key != "mesh":
            body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items())
            parts.append(f" {json.dumps(key)}: {{\n{body}\n }}")
        elif isinstance(value, list) and value:
            body = ",\n".join(f"  {json.dumps(v)}" for v in value)
            parts.append(f" {json.dumps(key)}: [\n{body}\n ]")
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}"
