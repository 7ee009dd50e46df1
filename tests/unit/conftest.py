"""Unit tests never compile: an XLA compile in tests/unit fails the test (compiling tests live in tests/sim).

Tracing (``jax.make_jaxpr``, ``jax.eval_shape``, abstract ``ShapeDtypeStruct`` arguments) is free;
running any jax computation, eager ones included, asks XLA to compile and is refused here.
"""
from __future__ import annotations

import jax._src.compiler as jax_compiler
import pytest


class CompileInUnitTest(AssertionError):
    """A unit test asked XLA to compile; move it to tests/sim or trace from shapes instead."""


@pytest.fixture(autouse=True)
def _no_compiling(monkeypatch):
    def refuse(*args, **kwargs):
        raise CompileInUnitTest("tests/unit must not compile (XLA was asked to compile a computation): "
                                "trace from jax.ShapeDtypeStruct shapes, or move the test to tests/sim")

    monkeypatch.setattr(jax_compiler, "compile_or_get_cached", refuse)
