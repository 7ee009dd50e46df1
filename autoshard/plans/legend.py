"""The notation and terms of autoshard's reports, each said once: ``autoshard explain --legend``, the explain
and HTML reports and the README read this table.

``LEGEND`` is a tuple of (term, meaning) pairs in the order a report uses them; ``SHORT_LEGEND`` is the one
line ``str(plan)`` ends with.
"""
from __future__ import annotations

LEGEND: tuple[tuple[str, str], ...] = (
    ("R", "a replicated dimension: every device holds all of it"),
    ("S(x)", "a dimension split over mesh axis x: each device along x holds 1/|x| of it"),
    ("S(x,y)", "a dimension split over axes x and y together (x the major one): 1/(|x|*|y|) per device"),
    ("RS(x), S(x)R, ...", "one letter group per dimension of the array, in order: RS(x) is dimension 0 "
                          "replicated and dimension 1 split over x"),
    ("()", "a scalar (no dimensions)"),
    ("A x B -> C @ {x,y}", "an op's strategy: the layouts it reads its inputs in, the layout of its output, and "
                           "the mesh axes it uses"),
    ("partial sum", "the result of a dot whose contracting dimension is split: each device holds a part of the "
                    "sum until an all-reduce (or reduce-scatter) adds them"),
    ("stacked partial sums", "a scanned stack's gradients kept unreduced over the loop, each device's own "
                             "partial sums, and reduced once after it instead of once per iteration"),
    ("resharding", "moving an array from the layout its producer left it in to the one its consumer reads "
                   "(an all-gather, all-to-all, slice, ...), priced on the edge between them"),
    ("collectives", "communication inside an op's strategy (the all-reduce of a partial sum); per device: the "
                    "bytes each device sends and receives by collective kind"),
    ("layout copy", "a copy XLA makes to put a dot's or convolution's operand in the order its kernel reads"),
    ("donation copy", "a copy XLA makes of a donated argument that is still read after its buffer is reused"),
    ("resharded", "memory held by an array's resharded copy while both layouts are live"),
    ("alike", "the optimizer state (Adam's mu and nu, ...) has its parameter's layout"),
    ("modeled step", "the step time under the cost model: roofline compute + alpha-beta collectives + "
                     "resharding (+ pipeline bubble); modeled, not measured"),
    ("compute lower bound", "all FLOPs at peak speed spread over every device: no plan is modeled faster"),
    ("latency-bound", "a step so short that one collective's fixed latency costs more than splitting the work "
                      "saves: its best plan keeps most arrays whole"),
    ("N nodes -> M classes", "the ILP's size: N ops of the traced step merged into M choices (an elementwise "
                             "op follows its producer, repeated layers share one choice)"),
    ("edges", "pairs of merged choices linked by a resharding cost"),
    ("gap", "how far a solve stopped by its time limit may be from the best plan under the model: 5% means "
            "no plan is modeled faster than 95% of this one's time"),
    ("optimal", "proven the fastest plan under the model within the search space, not measured fastest"),
    ("classic strategies", "what a plan is compared with: DP (data parallel, state replicated), FSDP/ZeRO-3 "
                           "(state fully split), ZeRO-2 (optimizer state and gradients split), HSDP (split inside a "
                           "node, replicated across), Megatron TP (tensor-parallel layers), DP x TP (both)"),
    ("speedup", "a classic plan's modeled step over autoshard's (2.00x: autoshard models half the time)"),
    ("fits", "the modeled peak memory per device is within the budget"),
    ("batch ceiling", "the largest global batch whose modeled peak still fits the budget"),
    ("bubble", "pipeline time stages spend idle waiting for microbatches"),
    ("stage cut", "the layers each pipeline stage runs and the devices it runs them on"),
)

SHORT_LEGEND = ("R replicated, S(x) split over mesh axis x, S(x,y) over x and y together, one group per "
                "dimension (RS(x): dim 1 split); `autoshard explain --legend` explains every term")


def legend_lines() -> list[str]:
    """The legend as plain text lines, ``term: meaning``."""
    width = max(len(term) for term, _ in LEGEND)
    return [f"{term:<{width}}  {meaning}" for term, meaning in LEGEND]
