"""What the intra-op pass returns: the chosen strategy of every node, its reshards, and what they add up to.

``IntraOpResult`` holds one plan on one logical mesh: per node its chosen strategy, per value the spec
it is produced in, the reshards between ops (``ReshardSite``), the ledger's time terms, the simulated
memory profile and how the ILP fared (``IlpStats``). Its methods are the plan's analytics: FLOPs and HBM
bytes per device, the collectives it runs (each distinct resharded copy once; an all-reduce that every
reader slices reported as the reduce-scatter XLA makes of it).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from autoshard.ir.graph import OpGraph, ValueId
from autoshard.ir.primitives import Values, primitives
from autoshard.ir.spec import Collective, Spec
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.hbm_traffic import collective_hbm_bytes, compute_dtype, local_slice_hbm_bytes
from autoshard.passes.objective import ObjectiveCheck
from autoshard.passes.strategies import Strategy

__all__ = ["IlpStats", "IntraOpResult", "PassClock", "PassTime", "ReshardSite"]


@dataclass(frozen=True)
class ReshardSite:
    op_index: int  # -1: carried state written back to its input's storage spec
    input_pos: int
    value: ValueId
    src: Spec
    dst: Spec
    seconds: float
    collectives: tuple[Collective, ...]
    path: tuple[Spec, ...] = ()  # intermediate layouts the priced plan passes through (pinned by emission)
    runs: int = 1  # times it runs per step (inside a loop: the trip count); ``seconds`` counts them all

    @property
    def chain(self) -> tuple[Spec, ...]:
        """Layouts to pin in order: the intermediates, then the target."""
        return tuple(self.path) + (self.dst,)


@dataclass(frozen=True)
class PassTime:
    """Seconds one planning pass took, summed over every time it ran for a plan."""

    wall_s: float
    cpu_s: float  # this process's CPU seconds (all threads): what the pass costs on an unloaded core
    runs: int = 1  # times it ran (the budget search solves and decodes again while a plan does not fit)


class PassClock:
    """Wall and CPU seconds per pass of the intra-op planner (``build``: strategies, classes, cost terms,
    search starts and the ILP; ``solve``; ``decode``: specs, reshards, pricing and the objective check;
    ``memory``: the simulated memory profile), accumulated as the budget search repeats them."""

    def __init__(self) -> None:
        self.totals: dict[str, tuple[float, float, int]] = {}

    @contextlib.contextmanager
    def timing(self, name: str, new_run: bool = True) -> Iterator[None]:
        """Time a block of pass ``name``; ``new_run=False``: another part of a run already counted."""
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            total = self.totals.get(name, (0.0, 0.0, 0))
            self.totals[name] = (total[0] + time.perf_counter() - wall, total[1] + time.process_time() - cpu,
                                 total[2] + new_run)

    def snapshot(self) -> dict[str, PassTime]:
        return {name: PassTime(wall, cpu, runs) for name, (wall, cpu, runs) in self.totals.items()}


@dataclass(frozen=True)
class IlpStats:
    num_nodes: int
    num_classes: int
    num_followers: int
    num_tied: int
    num_variables: int
    num_constraints: int
    num_edges: int
    status: str
    gap: float
    solve_s: float
    build_s: float
    objective_s: float = float("nan")  # the ILP's objective of the chosen plan (evaluate of its class choices)
    pass_times: Mapping[str, PassTime] = dataclasses.field(default_factory=dict)  # ``PassClock``: build..memory


@dataclass(frozen=True)
class IntraOpResult:
    graph: OpGraph
    mesh: LogicalMesh
    node_strategies: tuple[Strategy, ...]  # chosen, per node (inputs first, then ops)
    value_specs: Mapping[ValueId, Spec]  # spec each value is produced in
    input_specs: tuple[Spec, ...]  # storage spec per flat input
    output_specs: tuple[Spec, ...]  # per flat output (carried state: its input's storage spec)
    reshards: tuple[ReshardSite, ...]
    compute_s: float
    comm_s: float  # collectives inside chosen strategies
    reshard_s: float
    memory_profile: np.ndarray  # per-device live bytes at each program point
    memory_by_role: Mapping[str, float]  # at the peak
    ilp: IlpStats
    op_compute_s: tuple[float, ...] = ()  # per op: fused roofline seconds of its chosen strategy
    op_hbm_bytes: tuple[float, ...] = ()  # per op: per-device HBM bytes it reads and writes
    # per op: its collectives' seconds as XLA issues them (a combined all-reduce's latency on its first member)
    op_comm_s: tuple[float, ...] = ()
    input_s: float = 0.0  # the batch leaves' arrival from the host, as their storage specs split them
    # the ILP's objective, the objective recomputed on the unsimplified graph and the ledger (passes/objective.py)
    objective: ObjectiveCheck | None = None
    class_choices: np.ndarray | None = None  # the ILP's strategy per class that this plan was decoded from

    @property
    def flops_per_device(self) -> float:
        """FLOPs one device runs per step (XLA's count: transcendentals and data movement are not FLOPs)."""
        return float(sum(s.flops for s in self.node_strategies[len(self.graph.inputs):]))

    @property
    def hbm_bytes_per_device(self) -> float:
        """Bytes one device moves through HBM per step: the ops' fused traffic and the collectives'."""
        sizes = dict(zip(self.mesh.axis_names, self.mesh.shape))
        slices = {(r.op_index, r.value, r.dst): local_slice_hbm_bytes(self.graph, r.op_index, r.value, r.dst, sizes,
                                                                      bool(r.collectives)) for r in self.reshards}
        return (float(sum(self.op_hbm_bytes)) + sum(collective_hbm_bytes(c, self.mesh) for c in self.collectives())
                + float(sum(slices.values())))

    def flops_by_dtype(self) -> dict[str, float]:
        """``flops_per_device`` split by the peak each op runs at (``hbm_traffic.compute_dtype``)."""
        found: dict[str, float] = {}
        for j, op in enumerate(self.graph.ops):
            flops = float(self.op_strategy(j).flops)
            if flops:
                dtype = compute_dtype(op, self.graph)
                found[dtype] = found.get(dtype, 0.0) + flops
        return found

    def bound_split_s(self) -> tuple[float, float]:
        """(compute-bound, memory-bound) seconds: the ops whose roofline is set by FLOPs, by bytes."""
        cluster = self.mesh.cluster
        compute = memory = 0.0
        for j, op in enumerate(self.graph.ops):
            seconds = self.op_compute_s[j] if self.op_compute_s else 0.0
            flops_s = self.op_strategy(j).flops / cluster.peak_flops(compute_dtype(op, self.graph))
            if flops_s >= seconds * (1 - 1e-12):
                compute += seconds
            else:
                memory += seconds
        return compute, memory

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s + self.reshard_s + self.input_s

    @property
    def peak_bytes(self) -> float:
        return float(self.memory_profile.max()) if len(self.memory_profile) else 0.0

    def op_strategy(self, op_index: int) -> Strategy:
        return self.node_strategies[len(self.graph.inputs) + op_index]

    def collectives(self) -> list[Collective]:
        """Collectives the plan runs: each op's own, and each distinct resharded copy once (XLA
        computes a copy of one value in one layout once, however many ops read it). An all-reduce whose
        result is only read split over its axes (through views) is what XLA shows as a reduce-scatter
        (an all-reduce and a slice: ``compiler/hlo.py``), so it is reported as one, bytes unchanged."""
        return [c for _, c in self.collectives_by_op()]

    def collectives_by_op(self, part_of: Callable[[int], int] | None = None) -> list[tuple[int, Collective]]:
        """``collectives()`` with the op each belongs to: the op whose strategy runs it or whose input it
        reshards; -1 for the inputs' own and for carried state written back to its storage layout.

        A value resharded alike for several readers is priced once (one reshard feeds them all); with
        ``part_of`` (op index -> the program part running it: a pipeline stage's forward and backward are
        two executables) once per part that reads it, as each part must run it itself."""
        sliced = _sliced_after_all_reduce(self)
        ops = self.graph.ops
        found = [(t, _runs(dataclasses.replace(c, kind="reduce-scatter") if (t, k) in sliced else c,
                           ops[t].trip_count))
                 for t, s in enumerate(self.node_strategies[len(self.graph.inputs):])
                 for k, c in enumerate(s.collectives)]
        found += [(-1, c) for s in self.node_strategies[:len(self.graph.inputs)] for c in s.collectives]
        seen: set[tuple] = set()
        for site in self.reshards:
            key = (site.value, site.src, site.chain, site.runs,
                   part_of(site.op_index) if part_of is not None else 0)
            if key not in seen:
                seen.add(key)
                found += [(site.op_index, _runs(c, site.runs)) for c in site.collectives]
        return found

    def collective_bytes_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = collections.defaultdict(float)
        for c in self.collectives():
            out[c.kind] += c.nbytes
        return dict(out)


def _runs(collective: Collective, runs: int) -> Collective:
    """A collective run ``runs`` times (inside a loop), as one of all their bytes."""
    return collective if runs == 1 else dataclasses.replace(collective, nbytes=collective.nbytes * runs)


# ops XLA's all-reduce slicing looks through: the same elements rearranged or copied
_VIEW_CHAIN = primitives(lambda f: f.values in (Values.REARRANGED, Values.COPY))


def _sliced_after_all_reduce(result: IntraOpResult) -> set[tuple[int, int]]:
    """(op, collective index) of all-reduces every reader of whose result (through views) takes a layout
    split over all the all-reduce's axes: XLA slices them right after, which it reports as reduce-scatter."""
    graph = result.graph
    consumers = graph.consumers()
    index = {id(op): j for j, op in enumerate(graph.ops)}
    carried_spec = {graph.outputs[k]: result.input_specs[i] for k, i in enumerate(graph.carried or ())
                    if i is not None}
    read_specs: dict[ValueId, list[Spec]] = collections.defaultdict(list)
    for site in result.reshards:
        read_specs[site.value].append(site.dst)
    resharded_reads = {(site.op_index, site.value) for site in result.reshards}
    outputs = set(graph.outputs)
    found: set[tuple[int, int]] = set()
    for j, op in enumerate(graph.ops):
        strategy = result.op_strategy(j)
        for k, c in enumerate(strategy.collectives):
            if c.kind != "all-reduce" or len(op.outputs) != 1:
                continue
            wanted, frontier, ok, reads = set(c.axes), [op.outputs[0]], True, 0
            while frontier and ok:
                v = frontier.pop()
                if v in outputs and carried_spec.get(v) is None:
                    ok = False
                    break
                specs = list(read_specs.get(v, ())) + ([carried_spec[v]] if v in carried_spec else [])
                for user in consumers.get(v, ()):
                    u = index[id(user)]
                    if user.primitive in _VIEW_CHAIN and v not in read_specs:
                        frontier.extend(user.outputs)
                    elif (u, v) not in resharded_reads:
                        specs.append(result.value_specs[v])
                reads += len(specs)
                ok = all(wanted <= set(s.used_axes) for s in specs)
            if ok and reads:
                found.add((j, k))
    return found
