"""Where a plan's modeled step goes, layer by layer (``Plan.layer_times``), and the layer a path belongs to.

A ``LayerTime`` splits one layer's share of the modeled step into the four
parts the report stacks: compute bound by FLOPs, compute bound by HBM
traffic (the roofline's two sides), collectives inside op strategies, and
resharding between ops. ``compiler/layer_times.py`` fills them from a solved
plan; summed over the layers they are the ledger's compute, collective and
resharding times.

``layer_key`` names the layer of a parameter or optimizer-state path: the path
up to its first layer number (``['blocks'][3]``, ``['params']['Dense_3']``),
else its first key (``['lm_head']``), without the argument index and the
optimizer-state prefix (``[1][0].mu``).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

_ARGUMENT_PREFIX = re.compile(r"^\[\d+\](?:\[\d+\])*(?:\.\w+)?")
_ARG = re.compile(r"^\[\d+\]")  # the positional-argument index that starts every input path
T = TypeVar("T")


@dataclass(frozen=True)
class LayerTime:
    """One layer's share of the modeled step, in seconds per step."""

    name: str  # "blocks.3", "lm_head", ... (dotted ``layer_key``)
    flops_s: float  # compute of ops whose roofline is bound by FLOPs
    hbm_s: float  # compute of ops whose roofline is bound by HBM bandwidth
    comm_s: float  # collectives inside the layer's op strategies
    reshard_s: float  # resharding into the layer's ops (and state written back to its storage layout)

    @property
    def total_s(self) -> float:
        return self.flops_s + self.hbm_s + self.comm_s + self.reshard_s


def inner_path(path: str) -> str:
    """A leaf path without its argument index and optimizer-state prefix: ``[1][0].mu['w']`` -> ``['w']``."""
    return _ARGUMENT_PREFIX.sub("", path)


def layer_key(path: str) -> str:
    """The layer a leaf path belongs to, as a path prefix (module docstring)."""
    inner = inner_path(path)
    match = re.search(r"\[\d+\]|_\d+'\]", inner)
    if match:
        return inner[:match.end()]
    first = re.match(r"^\['[^']*'\]", inner)
    return first.group(0) if first else "(other)"


def dotted(path: str) -> str:
    """``['blocks']#['attn']['q']['kernel']`` -> ``blocks.#.attn.q.kernel`` (display only)."""
    keys = re.findall(r"\['([^']*)'\]|\.(\w+)|\[(\d+)\]|(#)", path)
    return ".".join(a or b or c or d for a, b, c, d in keys) or path


def state_slots(param_paths: Iterable[str], state: Mapping[str, T],
                same: Callable[[str, str], bool] | None = None) -> dict[str, dict[str, T]]:
    """Per parameter path, its optimizer-state leaves of ``state`` by slot (``{"mu": ..., "nu": ...}``).

    A state leaf belongs to the parameter whose path (without the argument index) ends its path, and for
    which ``same(parameter path, state path)`` holds (e.g. the same shape): ``[1][0].mu['blocks'][0]['q']``
    is slot ``mu`` of ``[0]['blocks'][0]['q']``.
    """
    params: dict[str, str] = {}
    for path in param_paths:
        params.setdefault(_ARG.sub("", path, count=1), path)
    found: dict[str, dict[str, T]] = {}
    own = set(params.values())
    for path, value in state.items():
        if path in own:
            continue
        inner = _ARG.sub("", path, count=1)
        for cut in (i for i, ch in enumerate(inner) if ch == "[" and i > 0):
            owner = params.get(inner[cut:])
            if owner is not None and (same is None or same(owner, path)):
                prefix = inner[:cut]
                slot = prefix.rsplit(".", 1)[-1] if "." in prefix else prefix
                found.setdefault(owner, {})[slot if slot not in found.get(owner, {}) else prefix] = value
                break
    return found
