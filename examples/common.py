"""Shared plumbing for the example workloads.

Every example module (``mlp``, ``gpt``, ``moe``, ``convnet``) exposes the same
interface, which the planner, the tests, the CLI and the benchmarks rely on::

    CONFIGS: dict[str, Config]           # at least "small" and "large"
    def workload(config="small", *, abstract=False, seed=0, batch_size=None) -> Workload

A :class:`Workload` bundles a pure, jittable train step with its arguments.
``params`` and ``opt_state`` are plain pytrees of arrays (dicts and optax
states), never Flax module objects, so ``step`` is a pure function of arrays.
With ``abstract=True`` nothing is materialized: the arguments are pytrees of
``jax.ShapeDtypeStruct`` obtained with ``jax.eval_shape`` on the initializer,
which is how the billion-parameter configs are used.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import jax
import optax

Params: TypeAlias = Any
"""A pytree of arrays (or of ``jax.ShapeDtypeStruct`` when abstract)."""
OptState: TypeAlias = Any
Batch: TypeAlias = dict[str, Any]
LossFn: TypeAlias = Callable[[Params, Batch], jax.Array]
StepFn: TypeAlias = Callable[[Params, OptState, Batch], tuple[Params, OptState, jax.Array]]
InitParamsFn: TypeAlias = Callable[[jax.Array], Params]
"""Builds the parameters from a PRNG key (traceable: it runs under eval_shape)."""
MakeBatchFn: TypeAlias = Callable[[jax.Array, int], Batch]
"""Builds a synthetic batch of the given size from a PRNG key (traceable)."""

ConfigT = TypeVar("ConfigT")

INIT_COMPILER_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
"""Compiler options for the one-off jitted initializer: no LLVM optimization, and XLA:CPU's loop emitters
instead of its MLIR fusion emitters (each cuts its compile time on CPU; other backends ignore the second)."""


@dataclass(frozen=True)
class Workload:
    """A train step and the arguments it runs on."""

    name: str
    """``"<model>-<config>"``, e.g. ``"gpt-small"``; ``"<model>-custom"`` for an unnamed Config."""
    step: StepFn
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``; pure and jittable."""
    args: tuple[Params, OptState, Batch]
    """``(params, opt_state, batch)``: concrete arrays, or ShapeDtypeStruct pytrees when abstract."""
    config: Any
    """The example module's frozen Config dataclass (with ``batch_size`` as used)."""
    loss_fn: LossFn
    """``loss_fn(params, batch) -> scalar``; the step differentiates exactly this."""
    init: Callable[[Any], tuple[Params, OptState, Batch]] | None = None
    """``init(seed) -> (params, opt_state, batch)``, traceable (``seed`` may be a traced int): jit it with
    ``out_shardings`` to build the arguments directly in a plan's layouts (launch bundles do)."""
    optimizer: optax.GradientTransformation | None = None
    """The optax optimizer ``step`` applies (a pipeline's marked step rebuilds the step with it)."""


def resolve_config(
    model: str, configs: Mapping[str, ConfigT], config: str | ConfigT, batch_size: int | None
) -> tuple[str, ConfigT]:
    """Return ``(workload name, config)`` for a config name or instance.

    ``batch_size`` (when given) replaces the config's ``batch_size`` field.
    """
    if isinstance(config, str):
        if config not in configs:
            raise KeyError(f"unknown {model} config {config!r}; choose one of {sorted(configs)}")
        label, resolved = config, configs[config]
    else:
        label = next((key for key, value in configs.items() if value == config), "custom")
        resolved = config
    if batch_size is not None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        resolved = dataclasses.replace(resolved, batch_size=batch_size)  # type: ignore[type-var]
    return f"{model}-{label}", resolved


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation) -> StepFn:
    """The standard step: ``jax.value_and_grad`` of the loss, then one optax update."""

    def step(params: Params, opt_state: OptState, batch: Batch) -> tuple[Params, OptState, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        return new_params, new_opt_state, loss

    return step


def build_workload(
    name: str,
    config: Any,
    *,
    init_params: InitParamsFn,
    make_batch: MakeBatchFn,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    abstract: bool,
    seed: int,
) -> Workload:
    """Assemble a :class:`Workload`; with ``abstract`` only shapes are computed.

    The parameter key and the batch key are both split from ``seed``, so a
    concrete workload is deterministic given the seed.
    """
    batch_size: int = config.batch_size

    def init(init_seed: Any = seed) -> tuple[Params, OptState, Batch]:
        params_key, batch_key = jax.random.split(jax.random.key(init_seed))
        params = init_params(params_key)
        return params, optimizer.init(params), make_batch(batch_key, batch_size)

    if abstract:
        args = jax.eval_shape(init)
    else:
        # Initialization runs once: XLA:CPU's backend optimizations would only add compile time.
        args = jax.jit(init, compiler_options=INIT_COMPILER_OPTIONS)()
    return Workload(
        name=name,
        step=make_train_step(loss_fn, optimizer),
        args=args,
        config=config,
        loss_fn=loss_fn,
        init=init,
        optimizer=optimizer,
    )


class InitKeys:
    """Stands in for ``nnx.Rngs`` when constructing NNX modules: ``params()`` keys.

    Each call returns ``fold_in(key, n)`` for n = 1, 2, ... counted in Python.
    ``nnx.Rngs`` keeps its counter in a jax array; updating it inside a trace
    (``jax.eval_shape``, ``jax.jit``) makes flax compare the tracer's
    ``sharding``, and jax builds an error message for that which walks the whole
    jaxpr traced so far: quadratic in the number of parameters, ~10 s for
    ``gpt.CONFIGS["xl"]`` against ~0.5 s with this class. Only the ``params``
    stream is offered: the examples use no dropout.
    """

    def __init__(self, key: jax.Array) -> None:
        self._key = key
        self._count = 0

    def params(self) -> jax.Array:
        self._count += 1
        return jax.random.fold_in(self._key, self._count)


def count_params(tree: Params) -> int:
    """Number of scalars in a pytree of arrays or ShapeDtypeStructs."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def is_abstract(tree: Any) -> bool:
    """True when every leaf of ``tree`` is a ``jax.ShapeDtypeStruct`` (nothing allocated)."""
    return all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(tree))
