"""Spec: how one array is laid out on a logical mesh; Collective: one communication a plan needs.

A Spec holds, per tensor dimension, the tuple of mesh axes that split it
(PartitionSpec semantics, major axis first). It prints compactly: ``S(x)R``
is a matrix split by rows over axis x and replicated over columns;
``S(x,y)R`` splits rows over x and y; a scalar prints as ``()``.
Partial sums never appear in a Spec: a strategy that contracts a split
dimension includes the reduction among its collectives and yields a plain Spec.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

MeshAxes: TypeAlias = tuple[str, ...]
CollectiveKind: TypeAlias = Literal["all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"]
COLLECTIVE_KINDS: tuple[CollectiveKind, ...] = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                                                "collective-permute")


@dataclass(frozen=True)
class Spec:
    dims: tuple[MeshAxes, ...]

    @staticmethod
    def replicated(rank: int) -> "Spec":
        return Spec(((),) * rank)

    @staticmethod
    def from_partition_spec(entries: Sequence[None | str | Sequence[str]], rank: int) -> "Spec":
        dims: list[MeshAxes] = []
        for i in range(rank):
            entry = entries[i] if i < len(entries) else None
            if entry is None:
                dims.append(())
            elif isinstance(entry, str):
                dims.append((entry,))
            else:
                dims.append(tuple(entry))
        return Spec(tuple(dims))

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def used_axes(self) -> MeshAxes:
        return tuple(a for d in self.dims for a in d)

    @property
    def is_replicated(self) -> bool:
        return not self.used_axes

    def num_shards(self, axis_sizes: Mapping[str, int]) -> int:
        n = 1
        for a in self.used_axes:
            n *= axis_sizes[a]
        return n

    def shard_shape(self, shape: Sequence[int], axis_sizes: Mapping[str, int]) -> tuple[int, ...]:
        """Per-device shape; a dimension that the shards do not divide is padded, as XLA does."""
        out = []
        for size, axes in zip(shape, self.dims):
            n = 1
            for a in axes:
                n *= axis_sizes[a]
            out.append(-(-size // n))
        return tuple(out)

    def divides(self, shape: Sequence[int], axis_sizes: Mapping[str, int]) -> bool:
        """True when every split dimension is divisible by its number of shards."""
        for size, axes in zip(shape, self.dims):
            n = 1
            for a in axes:
                n *= axis_sizes[a]
            if size % n:
                return False
        return True

    def partition_entries(self) -> tuple[None | str | tuple[str, ...], ...]:
        """Entries for ``jax.sharding.PartitionSpec(*entries)`` (only emit/runtime build the object)."""
        return tuple(None if not d else (d[0] if len(d) == 1 else d) for d in self.dims)

    def to_json(self) -> list[list[str]]:
        return [list(d) for d in self.dims]

    @staticmethod
    def from_json(data: Sequence[Sequence[str]]) -> "Spec":
        return Spec(tuple(tuple(str(a) for a in d) for d in data))

    def __str__(self) -> str:
        if not self.dims:
            return "()"
        return "".join("R" if not d else f"S({','.join(d)})" for d in self.dims)


@dataclass(frozen=True)
class Collective:
    """One collective a choice implies. ``nbytes`` is the per-device buffer as XLA's HLO shows it:
    the result for all-gather, the operand for reduce-scatter, the buffer for all-reduce, all-to-all
    and collective-permute (for a permute, ``axes`` are the mesh axes along which sender and
    receiver may differ)."""

    kind: CollectiveKind
    axes: MeshAxes
    nbytes: float

    def __str__(self) -> str:
        return f"{self.kind}[{','.join(self.axes)}]({self.nbytes:.3g}B)"


REDUCING: frozenset[CollectiveKind] = frozenset({"all-reduce", "reduce-scatter"})  # the kinds that sum partials


def partial_sums(collectives: Sequence[Collective]) -> tuple[Collective, ...]:
    """The reductions of a strategy's ``collectives`` that each read a partial-sum buffer: the first reduction's,
    one per output. A reduction over dims split over different axes runs one all-reduce per dim (as XLA
    does), each of the whole result: the later ones reduce what the first wrote, no partial sum of their own."""
    reducing = [c for c in collectives if c.kind in REDUCING]
    return tuple(c for c in reducing if c.axes == reducing[0].axes)
