"""The modeled step split per layer adds up to the ledger, and ops land in the layers they belong to.

One GPT-tiny plan is solved (1 s limit) on 2 nodes x 4 A100s, where the plan communicates, so collectives
and resharding have layers to land in; nothing is compiled.
"""
from __future__ import annotations

import pytest

from autoshard.compiler.driver import plan_step
from autoshard.compiler.layer_times import check_sums, layer_times, op_layers
from autoshard.passes.intra_op import IntraOpOptions
from examples import gpt


@pytest.fixture(scope="module")
def planned():
    work = gpt.workload("tiny", abstract=True, batch_size=64)
    return plan_step(work.step, work.args, mesh=(2, 4), cluster="2x8-a100",
                     options=IntraOpOptions(time_limit_s=1.0), memory_budget=4e6)


def test_layers_add_up_to_the_ledger(planned):
    led = planned.plan.ledger
    times = planned.plan.layer_times
    assert times == layer_times(planned.result)
    assert check_sums(times, led.compute_s, led.comm_s, led.reshard_s) == []
    assert led.comm_s + led.reshard_s > 0  # the plan communicates: the test below is not about zeros
    assert check_sums(times[1:], led.compute_s, led.comm_s, led.reshard_s) != []  # dropping a layer shows


def test_ops_land_in_their_layers(planned):
    graph = planned.graph
    labels = op_layers(graph)
    names = [t.name for t in planned.plan.layer_times]
    assert {"token_embed", "pos_embed", "blocks.0", "blocks.1", "ln_final", "lm_head"} <= set(names)
    # every op that reads a parameter of block 1 is in block 1
    params = {v for v in graph.inputs if "['blocks'][1]" in (graph.values[v].path or "")
              and graph.values[v].role.value == "param"}
    readers = [i for i, op in enumerate(graph.ops) if set(op.inputs) & params]
    assert readers and {labels[i] for i in readers} == {"blocks.1"}
    # the two blocks are the same layer twice: their compute is nearly the same (block 0 also holds the
    # embeddings' gradient scatters, which read its cotangent and no parameter)
    block0, block1 = (next(t for t in planned.plan.layer_times if t.name == n) for n in ("blocks.0", "blocks.1"))
    assert block0.flops_s + block0.hbm_s == pytest.approx(block1.flops_s + block1.hbm_s, rel=0.1)
