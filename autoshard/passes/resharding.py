"""Resharding: the collectives and seconds that move one array from one Spec to another.

A Spec is plain sharding (no pending sums): per tensor dimension, the mesh axes
that split it, major first. Axes of size 1 split nothing and are dropped first;
then identical specs cost nothing.

Vocabulary. For each dimension d, ``keep_d`` is the longest common prefix of
``src_d`` and ``dst_d``: those axes stay where they are. Every other axis of
the source must leave its dimension and every other axis of the target must
arrive in its dimension. A dimension is *clean* while its current axes are a
prefix of ``dst_d`` (it only needs axes appended) and *dirty* otherwise (it
still holds axes that must leave, which go minor-most first).

Steps. A plan is a sequence of steps, each turning one valid Spec into another
(every intermediate is a real layout, so every plan is a real algorithm):

- slice (free, local): append the next axis of ``dst_d`` to a clean dimension
  when no dimension uses that axis; the buffer shrinks.
- all-to-all over axes A (buffer = the current shard): a run A of minor-most
  axes of a dirty dimension i moves, in order, to the minor end of a clean
  dimension j whose next target axes are exactly A (``S(x)R -> RS(x)``: this
  is what XLA emits).
- all-gather over axis a (nbytes = the result): drop the minor-most axis of a
  dirty dimension.
- collective-permute (nbytes = the shard, one point-to-point message on the
  slowest link among the axes whose position changes): the same tile shape on
  another device order. XLA emits it for ``S(x,y)R -> S(y,x)R``, and, after a
  local slice, whenever each target tile lies inside one source tile
  (``S(x)R -> S(y)R`` on a (2, 4) mesh: one [n/4, m] block per device).

Decomposition. Candidates, the cheapest wins (ties, up to rounding: the earlier one):

1. Per mesh axis, greedily: first every free slice (axes only in ``dst``, so
   every later buffer is as small as it can be), then every all-to-all (axes
   that move between dimensions), and only when neither applies gather one
   minor-most axis (axes only in ``src``, or in another position in ``dst``,
   which are then sliced back) and repeat; every choice of which dimension to
   gather is tried. The same without all-to-alls (gather, then slice).
2. The same from ``src`` with each dimension's axes reordered (a permute of
   the source shard first), or towards ``dst`` reordered (a permute of the
   target shard last), in the order that suits the greedy: axes that stay
   first, then axes the other side does not use, then axes that move.
   ``S(x,y)R -> S(y)R`` is a permute to ``S(y,x)R`` and an all-gather of x;
   ``S(x)S(y) -> RS(x,y)`` is an all-to-all of x into ``RS(y,x)`` and a
   permute; ``S(x)R -> RS(x,y)`` on a large array slices y, moves x into
   ``RS(y,x)`` and permutes: all as XLA does them.
3. One collective-permute, when every target tile lies inside a source tile.
4. Two dimensions trading their minor-most axes of sizes that divide (``S(y)S(x)R -> S(x)S(y)R`` with
   |y| = 4, |x| = 2): XLA splits the larger axis, moves its extra sub-axis with one all-to-all and relabels
   the rest with one collective-permute, each of the shard's bytes (checked on a (2, 4) CPU mesh, unpinned);
   whole-axis plans would gather a whole axis first.

Consecutive all-gathers of one dimension merge into one over their axes
(priced hierarchically by ``meshes.cost.all_gather_s``); like XLA, different
dimensions are gathered apart, the last dimension first when the order does
not change the cost. Each all-to-all stays one collective (a run of axes moved
together is one all-to-all over all of them, priced by
``meshes.cost.all_to_all_s``); consecutive permutes merge into one. Going to fewer shards (``dst_d`` a prefix of
``src_d`` everywhere) is therefore one all-gather per shrunk dimension over
the axes it loses, the last one's result being the target shard; going to more
shards (``src_d`` a prefix of ``dst_d``) is free. Dimensions the shards do not divide are padded (XLA's
layout), so byte counts use ceiling division.

Path: ``Reshard.path`` lists the layouts the chosen plan passes through.
Pinned with ``with_sharding_constraint``, they make XLA run exactly this plan
(checked on a (2, 4) CPU mesh for every pair of rank-2 and rank-3 layouts: the
collectives XLA emits and their bytes agree with ``Reshard.collectives``). Left
to itself XLA sometimes gathers more (``S(x,y)R -> RS(x)``: all of it) or
splits an axis into sub-axes that whole-axis plans cannot express
(``S(y)R -> S(x)R`` with |y| = 4, |x| = 2: a permute and a half gather, which
this model prices as a full gather).

Soundness: each plan is a sequence of real collectives whose priced bytes on
each step are at least what a device receives in it, so the cost is never below
(bytes a device lacks) / (fastest link bandwidth); candidate 1 without
all-to-alls gathers no more than going to replicated does, so no reshard costs
more than an all-gather to replicated followed by a free slice.
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

from autoshard.ir.spec import Collective, CollectiveKind, MeshAxes, Spec
from autoshard.meshes import cost
from autoshard.meshes.logical import LogicalMesh

Layout: TypeAlias = tuple[MeshAxes, ...]  # per-dim mesh axes, size-1 axes dropped
Step: TypeAlias = tuple[CollectiveKind, MeshAxes, float]  # kind, axes, per-device nbytes as HLO shows it
_Raw: TypeAlias = tuple[CollectiveKind, MeshAxes, Layout, Layout]  # kind, axes, layout before, layout after
_Best: TypeAlias = tuple[float, tuple[Step, ...], tuple[Layout, ...]]  # seconds, steps, path


@dataclass(frozen=True)
class Reshard:
    """What one reshard costs: seconds under the alpha-beta model, and the collectives XLA would run."""

    seconds: float
    collectives: tuple[Collective, ...]  # per-device nbytes as HLO shows them (all-gather: result; all-to-all,
    #                                      collective-permute: buffer)
    path: tuple[Spec, ...] = ()  # layouts between src and dst that this plan passes through, in order: pin
    #                              them (with_sharding_constraint) and XLA runs this plan; left to itself it
    #                              may gather more (S(x,y)R -> RS(x): all of it, where S(x)R first halves that)

    @property
    def is_free(self) -> bool:
        return not self.collectives

    def __str__(self) -> str:
        if not self.collectives:
            return "free"
        return " + ".join(map(str, self.collectives)) + f" = {self.seconds * 1e6:.3g}us"


FREE = Reshard(0.0, ())
_TIE = 1 - 1e-9  # a later candidate must be cheaper by more than rounding to displace an earlier one


def reshard(shape: tuple[int, ...], dtype_bytes: int, src: Spec, dst: Spec, mesh: LogicalMesh) -> Reshard:
    """The cheapest plan (see the module docstring) that turns an array laid out as ``src`` into ``dst``."""
    return _reshard(tuple(int(s) for s in shape), int(dtype_bytes), src, dst, mesh)


def reshard_cost_matrix(shape: tuple[int, ...], dtype_bytes: int, srcs: Sequence[Spec], dsts: Sequence[Spec],
                        mesh: LogicalMesh) -> np.ndarray:
    """Seconds of every reshard, ``[len(srcs), len(dsts)]``; cached and read-only (copy it to change it)."""
    return _matrix(tuple(int(s) for s in shape), int(dtype_bytes), tuple(srcs), tuple(dsts), mesh)


def spec_options(shape: tuple[int, ...], mesh: LogicalMesh, *, max_split_dims: int = 2) -> list[Spec]:
    """Every layout of an array of ``shape`` on ``mesh``: the storage choices of a parameter or optimizer state.

    Each mesh axis (of size > 1) is unused or splits one dimension; axes inside
    one dimension follow mesh order; at most ``max_split_dims`` dimensions are
    split; every split divides its dimension. Replicated comes first. On 3 axes
    a rank-4 array has at most 101 options.
    """
    rank = len(shape)
    axes = [a for a in mesh.axes if a.size > 1]
    found: dict[Spec, None] = {}
    for placement in itertools.product(range(-1, rank), repeat=len(axes)):
        split = {d for d in placement if d >= 0}
        if len(split) > max_split_dims:
            continue
        dims: list[list[str]] = [[] for _ in range(rank)]
        counts = [1] * rank
        for axis, d in zip(axes, placement):
            if d >= 0:
                dims[d].append(axis.name)
                counts[d] *= axis.size
        if all(size % n == 0 for size, n in zip(shape, counts)):
            found.setdefault(Spec(tuple(tuple(d) for d in dims)), None)
    return list(found)


# ----------------------------------------------------------------------------- caches


@functools.lru_cache(maxsize=1 << 16)
def _reshard(shape: tuple[int, ...], dtype_bytes: int, src: Spec, dst: Spec, mesh: LogicalMesh) -> Reshard:
    ctx = _context(shape, dtype_bytes, mesh)
    seconds, steps, path = ctx.best(ctx.layout(src, "src"), ctx.layout(dst, "dst"))
    if not steps:
        return FREE
    collectives = tuple(Collective(kind, ctx.in_mesh_order(axes), nbytes) for kind, axes, nbytes in steps)
    return Reshard(seconds, collectives, tuple(Spec(layout) for layout in path))


@functools.lru_cache(maxsize=1 << 12)
def _matrix(shape: tuple[int, ...], dtype_bytes: int, srcs: tuple[Spec, ...], dsts: tuple[Spec, ...],
            mesh: LogicalMesh) -> np.ndarray:
    ctx = _context(shape, dtype_bytes, mesh)
    rows = [ctx.layout(s, "src") for s in srcs]
    cols = [ctx.layout(d, "dst") for d in dsts]
    out = np.array([[ctx.best(r, c)[0] for c in cols] for r in rows], dtype=np.float64).reshape(len(rows), len(cols))
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=1 << 10)
def _context(shape: tuple[int, ...], dtype_bytes: int, mesh: LogicalMesh) -> "_Context":
    return _Context(shape, dtype_bytes, mesh)


# ----------------------------------------------------------------------------- layouts and prices


class _Context:
    """Shape, element size and mesh of a reshard: byte counts and step prices, memoized."""

    def __init__(self, shape: tuple[int, ...], dtype_bytes: int, mesh: LogicalMesh) -> None:
        self.shape, self.dtype_bytes, self.mesh = shape, dtype_bytes, mesh
        self.sizes = {a.name: a.size for a in mesh.axes}
        self.order = {a.name: i for i, a in enumerate(mesh.axes)}
        self._nbytes: dict[Layout, float] = {}
        self._prices: dict[Step, float] = {}
        self._raw_prices: dict[_Raw, float] = {}
        self._best: dict[tuple[Layout, Layout], _Best] = {}

    def best(self, src: Layout, dst: Layout) -> _Best:
        """The cheapest candidate from ``src`` to ``dst``: seconds, steps with their byte counts, path."""
        found = self._best.get((src, dst))
        if found is None:
            found = self._best[src, dst] = self._search(src, dst)
        return found

    def _search(self, src: Layout, dst: Layout) -> _Best:
        if src == dst:
            return 0.0, (), ()
        best: tuple[float, tuple[_Raw, ...]] | None = None
        raw_prices = self._raw_prices
        for plan in _plans(src, dst):
            seconds = 0.0
            for step in plan:
                found = raw_prices.get(step)
                if found is None:
                    found = raw_prices[step] = self.price(self.sized(step))
                seconds += found
            if best is None or seconds < best[0] * _TIE:
                best = (seconds, plan)
        if all(n_dst % n_src == 0 for n_src, n_dst in zip(self.counts(src), self.counts(dst))):
            # candidate 3: a local slice to the target tile, then one permute to the right devices
            kept = {axis for s, d in zip(src, dst) for axis in _common_prefix(s, d)}
            moved = tuple(dict.fromkeys(axis for layout in (src, dst) for axes in layout for axis in axes
                                        if axis not in kept))
            permute: _Raw = ("collective-permute", moved, dst, dst)
            if best is None or self.price(self.sized(permute)) < best[0] * _TIE:
                best = (self.price(self.sized(permute)), (permute,))
        swapped = self._swapped(src, dst)
        if swapped is not None:
            seconds = sum(self.price(self.sized(step)) for step in swapped)
            if best is None or seconds < best[0] * _TIE:
                best = (seconds, swapped)
        assert best is not None
        seconds, plan = best
        path: list[Layout] = []
        for _, _, before, after in plan:
            path += [layout for layout in (before, after) if layout not in (src, dst, *path[-1:])]
        return seconds, tuple(map(self.sized, plan)), tuple(path)

    def _swapped(self, src: Layout, dst: Layout) -> tuple[_Raw, ...] | None:
        """Candidate 4: two dimensions trade their minor-most axes a and b whose sizes divide (|b| = k |a|,
        k >= 2), everything else kept. XLA splits the larger axis into sub-axes (b = b1 x b2, |b1| = |a|),
        moves b2 across with one all-to-all (k devices, the shard's bytes; priced over the whole axis b, an
        upper bound) and relabels b1 and a by one collective-permute of the shard: the tile shape is the same
        before and after. The middle layout names a sub-axis, so the plan has no path: XLA takes it unpinned."""
        changed = [d for d, (s, t) in enumerate(zip(src, dst)) if s != t]
        if len(changed) != 2:
            return None
        i, j = changed
        si, sj, di, dj = src[i], src[j], dst[i], dst[j]
        if not (si and sj and di and dj) or si[:-1] != di[:-1] or sj[:-1] != dj[:-1]:
            return None
        if not (si[-1] == dj[-1] and sj[-1] == di[-1]):
            return None
        big, small = sorted((si[-1], sj[-1]), key=self.sizes.__getitem__, reverse=True)
        if self.sizes[big] == self.sizes[small] or self.sizes[big] % self.sizes[small]:
            return None
        if any(size % n for layout in (src, dst) for size, n in zip(self.shape, self.counts(layout))):
            return None  # padded tiles: XLA's sub-axis plan is not checked there
        return (("all-to-all", (big,), src, dst), ("collective-permute", (small, big), src, dst))

    def sized(self, step: _Raw) -> Step:
        """A step with its per-device nbytes as HLO shows it: an all-gather's (padded) result, else the buffer."""
        kind, axes, before, after = step
        if kind == "all-gather":
            group = 1
            for a in axes:
                group *= self.sizes[a]
            return kind, axes, max(self.nbytes(after), self.nbytes(before) * group)
        return kind, axes, max(self.nbytes(before), self.nbytes(after))

    def layout(self, spec: Spec, which: str) -> Layout:
        if spec.rank != len(self.shape):
            raise ValueError(f"{which} spec {spec} has rank {spec.rank}, the array has shape {self.shape}")
        used = spec.used_axes
        unknown = [a for a in used if a not in self.sizes]
        if unknown:
            raise ValueError(f"{which} spec {spec} names axes {unknown} that mesh {self.mesh} does not have")
        if len(set(used)) != len(used):
            raise ValueError(f"{which} spec {spec} uses a mesh axis twice; each axis splits at most one dimension")
        return tuple(tuple(a for a in d if self.sizes[a] > 1) for d in spec.dims)

    def nbytes(self, layout: Layout) -> float:
        found = self._nbytes.get(layout)
        if found is None:
            n = self.dtype_bytes
            for size, count in zip(self.shape, self.counts(layout)):
                n *= -(-size // count)
            found = self._nbytes[layout] = float(n)
        return found

    def counts(self, layout: Layout) -> tuple[int, ...]:
        out = []
        for axes in layout:
            n = 1
            for a in axes:
                n *= self.sizes[a]
            out.append(n)
        return tuple(out)

    def in_mesh_order(self, axes: MeshAxes) -> MeshAxes:
        return tuple(sorted(set(axes), key=self.order.__getitem__))

    def price(self, step: Step) -> float:
        found = self._prices.get(step)
        if found is None:
            found = self._prices[step] = self._price(*step)
        return found

    def _price(self, kind: CollectiveKind, axes: MeshAxes, nbytes: float) -> float:
        if kind == "all-gather":
            return cost.all_gather_s(self.mesh, axes, nbytes)
        if kind == "all-to-all":
            return cost.all_to_all_s(self.mesh, axes, nbytes)
        if kind == "collective-permute":
            slowest = min((self.mesh.axis(a).link for a in axes), key=lambda link: link.bandwidth_bytes_per_s)
            return cost.point_to_point_s(nbytes, slowest)
        raise ValueError(f"resharding never emits {kind}")


# ----------------------------------------------------------------------------- candidate plans
#
# Plans are structural (independent of the shape and of axis sizes): a step names the layouts before
# and after it, which give its bytes (_Context.sized), so one cached list serves every array.


@functools.lru_cache(maxsize=1 << 16)
def _plans(src: Layout, dst: Layout) -> tuple[tuple[_Raw, ...], ...]:
    """Candidates 1 and 2 of the module docstring, merged and deduplicated."""
    if all(_is_prefix(s, d) for s, d in zip(src, dst)):
        return ((),)  # more shards: slices only
    if all(_is_prefix(d, s) for s, d in zip(src, dst)):
        # fewer shards: one all-gather per dimension, in every order (XLA's, last dimension first, on ties)
        dims = [i for i in reversed(range(len(src))) if len(src[i]) > len(dst[i])]
        plans = []
        for order in itertools.permutations(dims):
            cur, steps = src, []
            for i in order:
                nxt = cur[:i] + (dst[i],) + cur[i + 1:]
                steps.append(("all-gather", cur[i][len(dst[i]):], cur, nxt))
                cur = nxt
            plans.append(tuple(steps))
        return tuple(plans)
    return tuple(dict.fromkeys(_merge(raw) for raw in _raw_plans(src, dst)))


def _raw_plans(src: Layout, dst: Layout) -> Iterator[list[_Raw]]:
    """Unmerged step sequences of candidates 1 and 2; slices between steps are implicit."""
    crossing = any(axis in d for i, s in enumerate(src) for j, d in enumerate(dst) if i != j for axis in s)
    for src_r in dict.fromkeys((src, _aligned(src, dst))):
        head: list[_Raw] = [] if src_r == src else [("collective-permute", _changed(src, src_r), src, src_r)]
        for dst_r in dict.fromkeys((dst, _aligned(dst, src))):
            tail: list[_Raw] = [] if dst_r == dst else [("collective-permute", _changed(dst, dst_r), dst_r, dst)]
            for moves in (True, False) if crossing else (False,):
                for body in _greedy(src_r, dst_r, moves):
                    yield head + list(body) + tail


def _merge(steps: Sequence[_Raw]) -> tuple[_Raw, ...]:
    """Consecutive all-gathers of one dimension become one and consecutive permutes one. Each
    all-to-all stays apart (it moves one run between one pair of dimensions), as XLA runs them."""
    out: list[_Raw] = []
    for kind, axes, before, after in steps:
        prev = out[-1] if out else None
        if prev is not None and prev[0] == kind and (
                (kind == "all-gather" and prev[3] == before and _dim_of(prev) == _dim_of((kind, axes, before, after)))
                or kind == "collective-permute"):
            _, prev_axes, prev_before, _ = out[-1]
            out[-1] = (kind, prev_axes + tuple(a for a in axes if a not in prev_axes), prev_before, after)
        else:
            out.append((kind, axes, before, after))
    return tuple(out)


def _dim_of(step: _Raw) -> int:
    """The dimension an all-gather shrinks."""
    _, _, before, after = step
    return next(i for i, (b, a) in enumerate(zip(before, after)) if b != a)


@functools.lru_cache(maxsize=1 << 16)
def _greedy(cur: Layout, dst: Layout, moves: bool) -> tuple[tuple[_Raw, ...], ...]:
    """Free slices, then all-to-alls; when stuck, each way of gathering one minor-most axis (all completions)."""
    cur, steps = _advance(cur, dst, moves)
    if cur == dst:
        return (steps,)
    found: list[tuple[_Raw, ...]] = []
    for i in reversed(range(len(cur))):  # last dimension first, as XLA does, when costs tie
        axes = cur[i]
        if not _is_prefix(axes, dst[i]):
            nxt = cur[:i] + (axes[:-1],) + cur[i + 1:]
            gather: _Raw = ("all-gather", (axes[-1],), cur, nxt)
            found += [steps + (gather,) + rest for rest in _greedy(nxt, dst, moves)]
    return tuple(found)


def _advance(cur: Layout, dst: Layout, moves: bool) -> tuple[Layout, tuple[_Raw, ...]]:
    """Apply free slices and (if ``moves``) all-to-alls until neither applies."""
    dims = list(cur)
    steps: list[_Raw] = []
    while True:
        used = {a for axes in dims for a in axes}
        for d, target in enumerate(dst):
            n = len(dims[d])
            while n < len(target) and target[:n] == dims[d] and target[n] not in used:
                used.add(target[n])
                dims[d] = target[: n + 1]
                n += 1
        if not moves or not _move(dims, dst, steps):
            return tuple(dims), tuple(steps)


def _move(dims: list[MeshAxes], dst: Layout, steps: list[_Raw]) -> bool:
    """One all-to-all: the longest minor-most run of a dirty dimension that a clean one takes next."""
    for i, axes in enumerate(dims):
        if dst[i][: len(axes)] == axes:
            continue  # clean
        for length in range(len(axes), 0, -1):
            run = axes[-length:]
            for j, target in enumerate(dst):
                held = len(dims[j])
                if j != i and target[held:held + length] == run and target[:held] == dims[j]:
                    before = tuple(dims)
                    dims[i], dims[j] = axes[:-length], dims[j] + run
                    steps.append(("all-to-all", run, before, tuple(dims)))
                    return True
    return False


def _aligned(layout: Layout, other: Layout) -> Layout:
    """``layout`` with each dimension's axes reordered (same tile shape) to suit a reshard to or from
    ``other``: first the axes ``other`` has in that dimension (in its order: they can stay), then the
    axes ``other`` does not use (gathered away from a source, sliced first into a target), then the
    axes that move between dimensions (all-to-all), each group as it was."""
    used = {a for axes in other for a in axes}
    out = []
    for axes, ref in zip(layout, other):
        first = tuple(a for a in ref if a in axes)
        rest = [a for a in axes if a not in first]
        out.append(first + tuple(a for a in rest if a not in used) + tuple(a for a in rest if a in used))
    return tuple(out)


def _changed(a: Layout, b: Layout) -> MeshAxes:
    return tuple(x for da, db in zip(a, b) if da != db for x in da)


def _common_prefix(a: Sequence[str], b: Sequence[str]) -> MeshAxes:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return tuple(a[:n])


def _is_prefix(a: MeshAxes, b: MeshAxes) -> bool:
    return b[: len(a)] == a
