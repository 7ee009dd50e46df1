"""The parts of a Plan that are plain records: the ledger, solver statistics, explanations; formatting.

``Ledger`` is what the cost model predicts for one step (time split, per-device memory by kind,
collective bytes, the compute lower bound); ``SolverInfo`` how the ILP fared; ``Choice`` and
``OpExplanation`` why an op got its strategy (``compiler/explain.py`` fills them). ``fmt_bytes``,
``fmt_s`` and ``solver_summary`` format them for people.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

GIB = 1024**3


def fmt_bytes(n: float) -> str:
    """1.5 GiB, 12.3 MiB, 640 B: for people."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(float(f"{n / size:.3g}")) >= 1:  # rounded as printed: 1023.9 KiB is 1 MiB, not "1.02e+03 KiB"
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_gap(gap: float, digits: int = 2) -> str:
    """A solver's relative gap: "3.5%", or "no bound" when the solve stopped before it had one (infinite)."""
    return f"{gap:.{digits}%}" if math.isfinite(gap) else "no bound"


def fmt_s(seconds: float) -> str:
    """3.2 ms, 41 µs, 1.2 s: for people."""
    if seconds == 0:
        return "0"
    seconds = float(f"{seconds:.3g}")  # round first: 0.9999 ms is 1 ms, not "1e+03 µs"
    if abs(seconds) >= 1:
        return f"{seconds:.3g} s"
    if abs(seconds) >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


@dataclass(frozen=True)
class Ledger:
    compute_s: float
    comm_s: float  # collectives inside op strategies (partial-sum reductions)
    reshard_s: float  # resharding between ops, including state written back to its storage layout
    bubble_s: float  # pipeline bubbles (0 for SPMD)
    peak_memory_bytes: float  # per device
    memory_by_kind: Mapping[str, float]  # per device at the peak: param, opt_state, batch, activation, resharded, ...
    collective_bytes: Mapping[str, float]  # predicted per-device bytes by collective kind
    compute_lower_bound_s: float  # total FLOPs / (devices x peak)
    # predicted per device per step, checked against the compiled program's cost_analysis() (verify)
    flops_per_device: float = 0.0  # XLA's count: transcendentals and data movement are not FLOPs
    hbm_bytes_per_device: float = 0.0  # bytes read + written through HBM, as XLA fuses (collectives included)
    # compute_s split by what bounds each op's roofline: FLOPs at peak, or bytes at HBM bandwidth
    compute_bound_s: float = 0.0
    memory_bound_s: float = 0.0
    # flops_per_device split by the peak each op runs at (``strategies.base.op_dtype``: "tfloat32", "bfloat16",
    # ...): a fp32-master / bf16-compute step runs its dots at the bf16 peak although its parameters are fp32
    flops_by_dtype: Mapping[str, float] = field(default_factory=dict)
    input_s: float = 0.0  # the batch's arrival from the host (ClusterSpec.host_bandwidth_bytes_per_s)
    # the step priced from the program XLA compiled for this plan (compiler/verify.compiled_price, on the same
    # ClusterSpec: FLOPs at peak, bytes accessed at HBM bandwidth, each collective at its replica groups' links);
    # 0: not compiled (check="compiled" compiles it)
    compiled_step_s: float = 0.0
    compiled_compute_s: float = 0.0
    compiled_collectives_s: float = 0.0

    @property
    def prediction_error(self) -> float | None:
        """(modeled - compiled) / compiled step; None when the plan was not compiled."""
        if self.compiled_step_s <= 0:
            return None
        return (self.step_s - self.compiled_step_s) / self.compiled_step_s

    @property
    def main_compute_dtype(self) -> str | None:
        """The dtype most of the step's FLOPs run in (None when unknown: a plan file without the split)."""
        return max(self.flops_by_dtype, key=lambda d: self.flops_by_dtype[d]) if self.flops_by_dtype else None

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s + self.reshard_s + self.bubble_s + self.input_s

    @property
    def communication_s(self) -> float:
        """Collectives inside ops and resharding between them."""
        return self.comm_s + self.reshard_s

    def bound_shares(self) -> dict[str, float]:
        """Fractions of the step that are compute-bound, memory-bound, communication and bubble."""
        total = self.step_s
        if total <= 0:
            return {}
        return {"compute-bound": self.compute_bound_s / total, "memory-bound": self.memory_bound_s / total,
                "communication": self.communication_s / total, "bubble": self.bubble_s / total,
                "batch from host": self.input_s / total}


@dataclass(frozen=True)
class SolverInfo:
    status: str
    gap: float
    solve_s: float
    num_nodes: int
    num_classes: int
    num_variables: int
    num_constraints: int
    num_edges: int


def solver_summary(info: SolverInfo) -> str:
    """How the solve ended, in words: proven optimal, or stopped at the time limit with what the gap means."""
    if info.status == "stage-dp":  # the pipeline's stage DP (compiler/pipeline_plan.py): exact over its choices
        return (f"stage-dp: exact over {info.num_nodes} layers x {info.num_classes} sub-meshes; {info.solve_s:.2f}s "
                "(each stage's own plan: see the stages)")
    size = f"{info.solve_s:.2f}s; {info.num_nodes} nodes -> {info.num_classes} classes, {info.num_edges} edges"
    bound = f"no plan is modeled faster than {1 - info.gap:.0%} of this one" if info.gap < 1 else "no bound yet"
    finite = math.isfinite(info.gap)
    gap = f"gap {fmt_gap(info.gap)} ({bound})" if finite else "gap no bound (the solve had none yet)"
    if info.status.startswith("feasible (memory budget lowered"):  # passes/budget_search.bounded
        at_budget = (f"gap {fmt_gap(info.gap)} against the bound at the budget ({bound})" if finite
                     else "gap no bound (none at the budget yet)")
        return (f"{info.status}: the plan at the budget itself peaked over it with the copies the ILP does not "
                f"count, so it was re-solved below the budget; {at_budget}; {size}")
    if info.status.startswith("feasible"):
        return f"{info.status}: stopped at the time limit, {gap}; {size}"
    if info.status.startswith("optimal"):
        return f"{info.status}: proven under the model; {size}"
    if info.gap > 0 and finite:  # a least-memory plan or the search's start, with a bound
        return f"{info.status}: {gap}; {size}"
    return f"{info.status}; {size}"


@dataclass(frozen=True)
class Choice:
    """One strategy of one op, priced in seconds as its share of the objective with the rest of the plan fixed
    (``passes/objective.PlanObjective``): two choices' totals differ as the modeled step does."""

    strategy: str  # e.g. "S(x)R x RS(y) -> S(x)S(y) @ {x,y}"
    compute_s: float
    comm_s: float  # collectives the strategy itself needs (an alternative: and the change of combined latencies)
    # the reshards charged to the op; an alternative adds the change of every reshard it touches, its consumers'
    # included (negative when it spares them one)
    reshard_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.reshard_s


@dataclass(frozen=True)
class OpExplanation:
    """Why an op got its strategy: the chosen one and the cheapest alternatives, each priced as a ``Choice``."""

    primitive: str
    source: str  # file:line (function), when jax knows it
    shapes: str  # "f32[24,8,48] x f32[48,48] -> f32[24,8,48]"
    chosen: Choice
    alternatives: tuple[Choice, ...]  # cheapest first
    num_strategies: int  # how many the rule table offered
    loop: str = ""  # how the loop around the op (a scan's body) was planned; "" outside every loop


class Explanations(Mapping[int, OpExplanation]):
    """``Plan.explanations`` made when first read: pricing every op's alternatives costs about a second on a
    small plan and seconds on a large one (``compiler/explain.py``), while most plans made (weighed, run,
    tested) are never explained; ``explain``, the report and a plan file read them. A pickled or copied plan
    carries them made."""

    def __init__(self, make: Callable[[], Mapping[int, OpExplanation]]) -> None:
        self._make: Callable[[], Mapping[int, OpExplanation]] | None = make
        self._made: dict[int, OpExplanation] | None = None

    def _value(self) -> dict[int, OpExplanation]:
        if self._made is None:
            assert self._make is not None
            self._made, self._make = dict(self._make()), None  # the maker (and the result it holds) let go
        return self._made

    def __getitem__(self, op: int) -> OpExplanation:
        return self._value()[op]

    def __iter__(self) -> Iterator[int]:
        return iter(self._value())

    def __len__(self) -> int:
        return len(self._value())

    def __reduce__(self) -> tuple[type, tuple[dict[int, OpExplanation]]]:
        return dict, (self._value(),)

    def __repr__(self) -> str:
        return repr(self._value()) if self._made is not None else "Explanations(<made when read>)"
