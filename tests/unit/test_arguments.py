"""Every argument of the API is checked before any tracing or planning, and says what to change in one line
(``autoshard/arguments.py``; the command line's flags: tests/unit/test_promises.py, section 7)."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import pytest

import autoshard
from autoshard.arguments import CLI_NAMES, check_arguments, parse_bytes
from autoshard.errors import ArgumentError, InfeasibleMemoryError


class Traced:
    """A train step that counts its traces: a check that comes first leaves it at 0."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, params, batch):
        self.count += 1
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((batch @ p) ** 2))(params)
        return params - 0.1 * grads, loss


ARGS = (jnp.ones((16, 16)), jnp.ones((8, 16)))


def test_a_mesh_beyond_the_devices_fails_in_one_line_before_tracing(devices8):
    step, decorate = Traced(), autoshard.autoshard  # imported: the clock starts at the call
    start = time.perf_counter()
    with pytest.raises(ArgumentError) as err:
        decorate(step, mesh=(3, 3))(*ARGS)
    assert time.perf_counter() - start < 2
    assert str(err.value) == "mesh 3x3 needs 9 devices but 8 are present: use a mesh of at most 8 devices"
    with pytest.raises(ArgumentError, match=r"^mesh 3x3 needs 9 devices but 8 are present: .*pass cluster"):
        autoshard.plan(step, *ARGS, mesh=(3, 3))
    with pytest.raises(ArgumentError, match=r"^mesh 3x3 needs 9 devices but cluster cpu-8 has 8"):
        autoshard.autoshard(step, mesh=(3, 3), cluster="cpu-8")  # no devices needed: refused when decorated
    assert step.count == 0


def test_a_one_device_cluster_describes_the_chip_and_plans_any_mesh():
    # what `autoshard profile` writes on one GPU: planning 8 of that chip is the point of profiling it
    from autoshard.meshes.cluster import PRESETS

    chip = PRESETS["1x8-h100"].with_devices(1, 1)
    assert check_arguments(mesh=(2, 4), cluster=chip).mesh_devices == 8
    with pytest.raises(ArgumentError, match=r"needs 16 devices but cluster .* has 8"):
        check_arguments(mesh=(4, 4), cluster=PRESETS["1x8-h100"])


@pytest.mark.parametrize("kwargs, pattern", [
    ({"memory_budget": "1000"}, r"memory_budget '1000' has no unit: write .* 1000GiB"),
    ({"memory_budget": 0}, r"memory_budget must be a positive size, got 0"),
    ({"memory_budget": "-2GiB"}, r"memory_budget '-2GiB' is not a size"),
    ({"memory_budget": "4 GiBs"}, r"unknown unit 'GiBs'"),
    ({"memory_budget": [1]}, r"memory_budget must be bytes \(a number\) or a size with a unit"),
    ({"schedule": "zero-bubble"}, r"schedule must be one of 1f1b, gpipe, interleaved, got 'zero-bubble'"),
    ({"num_stages": 0}, r"num_stages must be a positive integer \(pipeline stages\), got 0"),
    ({"num_stages": 9, "cluster": "cpu-8"}, r"num_stages 9 is more stages than the 8 devices"),
    ({"num_microbatches": 2.5}, r"num_microbatches must be a positive integer"),
    ({"while_trip_count": True}, r"while_trip_count must be a positive integer"),
    ({"mesh": (2, 0)}, r"mesh must be a shape of positive integers"),
    ({"cluster": "a1OO"}, r"cluster: unknown cluster 'a1OO'"),
])
def test_every_argument_is_checked_when_decorated(kwargs, pattern):
    step = Traced()
    with pytest.raises(ArgumentError, match=pattern):
        autoshard.autoshard(step, **kwargs)
    with pytest.raises(ArgumentError, match=pattern):
        autoshard.plan(step, *ARGS, **kwargs)
    assert step.count == 0


def test_sizes_with_units():
    assert parse_bytes("40GiB") == 40 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1.5e9
    assert parse_bytes("2e3kib") == 2000 * 1024
    assert parse_bytes(1000) == 1000.0  # a number is bytes, as before
    with pytest.raises(ArgumentError, match=r"^--memory-budget '40' has no unit"):
        parse_bytes("40", CLI_NAMES.memory_budget)
    assert check_arguments(memory_budget="1GiB").memory_budget == 2**30


def test_an_impossible_budget_is_known_before_the_search_and_names_memory_budget(devices8):
    """The floor (parameters and optimizer state over every device) refuses the budget right after the trace:
    no mesh is solved."""
    said: list[str] = []
    with pytest.raises(InfeasibleMemoryError, match=r"alone take .* raise memory_budget above") as err:
        autoshard.plan(Traced(), *ARGS, memory_budget="100B", num_stages=1, progress=said.append)
    assert not [line for line in said if line.startswith("solving")], said
    assert err.value.naming("--memory-budget").endswith("raise --memory-budget above 128 B or use more devices")
