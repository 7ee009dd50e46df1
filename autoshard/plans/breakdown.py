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
from dataclasses import dataclass

_ARGUMENT_PREFIX = re.compile(r"^\[\d+\](?:\[\d+\])*(?:\.\w+)?")


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
