"""The example workloads without running them: interface, options, abstract large configs (tests/sim runs them)."""
from __future__ import annotations

import dataclasses
import functools
import time
from types import ModuleType

import jax
import jax.numpy as jnp
import pytest

from examples import Workload, convnet, count_params, gpt, gpt_scan, is_abstract, mlp, moe, moe_topk

MODULES: dict[str, ModuleType] = {"mlp": mlp, "gpt": gpt, "gpt_scan": gpt_scan, "moe": moe, "moe_topk": moe_topk,
                                  "convnet": convnet}


def _live_bytes() -> int:
    return sum(array.nbytes for array in jax.live_arrays())


@pytest.mark.parametrize("model", sorted(MODULES))
def test_module_interface(model: str) -> None:
    module = MODULES[model]
    assert {"small", "large"} <= set(module.CONFIGS)
    for config in module.CONFIGS.values():
        assert dataclasses.is_dataclass(config)
        with pytest.raises(dataclasses.FrozenInstanceError):
            config.batch_size = 1  # type: ignore[misc]
    small = module.CONFIGS["small"]
    assert small.batch_size % 8 == 0 and small.batch_size % 6 == 0
    if hasattr(small, "vocab_size"):
        assert small.vocab_size % 8 == 0


def test_workload_options() -> None:
    resized = mlp.workload("tiny", batch_size=12, abstract=True)
    assert resized.args[2]["x"].shape[0] == 12 and resized.config.batch_size == 12

    variant = dataclasses.replace(gpt.CONFIGS["small"], num_layers=3)
    custom = gpt.workload(variant, abstract=True)
    assert custom.name == "gpt-custom" and custom.config == variant
    assert len(custom.args[0]["blocks"]) == 3
    assert gpt.workload(gpt.CONFIGS["small"], abstract=True).name == "gpt-small"
    with pytest.raises(KeyError, match="unknown gpt config"):
        gpt.workload("nope", abstract=True)


@functools.cache
def _gpt_large() -> tuple[Workload, float, int]:
    """The abstract gpt-large workload, its build seconds and the live bytes it added."""
    before = _live_bytes()
    start = time.process_time()
    work = gpt.workload("large", abstract=True)
    return work, time.process_time() - start, _live_bytes() - before


def test_gpt_large_abstract_builds_fast_without_allocating() -> None:
    work, seconds, allocated_bytes = _gpt_large()
    assert seconds < 10, f"abstract gpt-large took {seconds:.1f} s to build"
    assert is_abstract(work.args)
    assert allocated_bytes < 1 << 20, f"building an abstract workload allocated {allocated_bytes} bytes"
    assert work.config.num_layers >= 24 and len(work.args[0]["blocks"]) >= 24
    assert count_params(work.args[0]) >= 1e9
    assert work.args[2]["tokens"].shape == (work.config.batch_size, work.config.seq_len + 1)


def test_gpt_large_traces_fast() -> None:
    work, _, _ = _gpt_large()
    start = time.process_time()
    closed = jax.make_jaxpr(work.step)(*work.args)
    seconds = time.process_time() - start
    assert seconds < 10, f"make_jaxpr of abstract gpt-large took {seconds:.1f} s"
    loss_aval = closed.out_avals[-1]
    assert loss_aval.shape == () and loss_aval.dtype == jnp.float32
    n_dots = sum(eqn.primitive.name == "dot_general" for eqn in closed.jaxpr.eqns)
    assert n_dots >= 3 * 8 * work.config.num_layers  # 8 forward dots per block, 2 backward each


@pytest.mark.parametrize(("model", "name", "min_params"), [
    ("gpt", "xl", 6e9), ("moe", "large", 1e9), ("moe_topk", "large", 1e9), ("mlp", "large", 1e8),
    ("convnet", "large", 1e7),
])
def test_big_configs_are_abstract(model: str, name: str, min_params: float) -> None:
    work = MODULES[model].workload(name, abstract=True)
    assert is_abstract(work.args)
    assert count_params(work.args[0]) >= min_params


def test_gpt_scan_is_gpt_with_stacked_blocks() -> None:
    """The scanned GPT holds the unrolled one's parameters, each block leaf stacked over the layers, and its
    traced step keeps one scan over them (forward and transposed), not num_layers copies."""
    config = gpt.CONFIGS["large"]
    scanned, unrolled = gpt_scan.workload("large", abstract=True), gpt.workload("large", abstract=True)
    assert count_params(scanned.args[0]) == count_params(unrolled.args[0])
    q = scanned.args[0]["blocks"]["attn"]["q"]["kernel"]
    assert q.shape == (config.num_layers, config.d_model, config.d_model)
    jaxpr = jax.make_jaxpr(scanned.step)(*scanned.args)
    assert sum(e.primitive.name == "scan" for e in jaxpr.jaxpr.eqns) >= 2
