"""The intra-op solves a stage search prices with: one per (layer class, sub-mesh and logical mesh, microbatch
size, state mode), whatever the stage count and the cut.

A stage's time and memory are sums over its layers of each layer's intra-op plan on the stage's logical mesh
(``passes/stage_costs.py``), so nothing about a solve depends on which stage holds the layer, how many stages
there are, or where the cuts fall: only on

- the layer class (``Layer.structure``: repeated and tied layers are one class),
- the sub-mesh and its logical shape (which devices, so which links, and how they are named),
- the microbatch size the layer's train graph was traced at (B = 1 and B = r; a forced B: one size),
- the state mode (``"fast"``, ``"lean"``, ``"dp"``: what is pinned before the ILP runs).

Recomputation is not a key: a recomputing stage reads the same solve (its ``fused_*`` figures, the forward
and backward as one program). :class:`LayerSolves` is that cache; it solves on a miss and counts the solves;
it also keys each solve by the pricing's :class:`SolveSettings` (what else a solve reads: the cluster, the
time limit, the budget), so one cache serves pricings of other settings without mixing them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from autoshard.meshes.cluster import ClusterSpec
from autoshard.passes.stage_problem import SubmeshShape

Cost = TypeVar("Cost")


@dataclass(frozen=True)
class SolveKey:
    """What one layer solve depends on (module docstring)."""

    layer_class: str  # the layer structure hash
    submesh: SubmeshShape
    mesh_shape: tuple[int, ...]  # the logical mesh on the sub-mesh
    microbatch: int  # examples per microbatch in the train graph solved
    mode: str  # "fast" | "lean" | "dp"


@dataclass(frozen=True)
class SolveSettings:
    """What a layer solve reads besides its key: the same for every solve a cache holds."""

    cluster: ClusterSpec  # the links and devices the logical meshes are made on
    time_limit_s: float
    memory_budget_bytes: float
    opt_ratio: float  # optimizer-state bytes per gradient-accumulator byte


@dataclass(eq=False)
class LayerSolves(Generic[Cost]):
    """Layer solves by :class:`SolveKey` (under the pricing's :class:`SolveSettings`), made on a miss."""

    costs: dict[tuple[SolveSettings, SolveKey], Cost] = field(default_factory=dict)
    solves: int = 0  # solves made (each miss solves once)

    def has(self, settings: SolveSettings, key: SolveKey) -> bool:
        return (settings, key) in self.costs

    def cost(self, settings: SolveSettings, key: SolveKey, solve: Callable[[], Cost]) -> Cost:
        """The solve of ``key`` under ``settings``: ``solve()`` the first time, the kept result after."""
        if (settings, key) not in self.costs:
            self.costs[settings, key] = solve()
            self.solves += 1
        return self.costs[settings, key]
