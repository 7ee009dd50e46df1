"""A step's jaxpr at another batch size, from its jaxprs at two: no third trace.

A pipeline plans a step at its full batch N and at one microbatch N / r (two traces, ``ir/step_trace.py``); the
stage DP may then choose a third microbatch count B, and the runtime runs the step at N / B. Tracing the user's
step again there is what this module avoids: the two traces, taken equation by equation, say which numbers of
the program depend on the batch (a shape entry, a reshape's sizes, a mean's divisor) and how: a number equal in
both does not; one r times larger at N is proportional to the batch; one r times smaller is inversely
proportional. :func:`extrapolate` writes the jaxpr with every such number at N / B, and checks the result with
jax's own type rules (``check_jaxpr``).

It returns None, and the caller traces, when the two jaxprs differ in any other way: other equations, a number
that is neither constant nor proportional (``N - 1``, ``sqrt(N)``), a constant array or an opaque parameter
(a callable) that differs, a size that does not divide. A step whose Python takes another branch at N / B
than at both N and N / r (``if batch % 3``) is the one case it cannot see.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
from jax._src import core as jax_core
from jax._src import linear_util as lu
from jax.extend import core as jcore

log = logging.getLogger(__name__)


class _Differs(Exception):
    """The two jaxprs differ in a way no batch size explains (the message says where)."""


class _Scaler:
    """Maps a value at the full batch (``a``) and at batch / ratio (``b``) to its value at batch / count."""

    def __init__(self, ratio: int, count: int, check_rules: bool = True) -> None:
        self.ratio, self.count = ratio, count
        self.check_rules = check_rules  # trace each custom_jvp rule's gradient case now (not inside a rule)
        self.vars: dict[Any, Any] = {}  # full-batch Var -> its Var at batch / count
        self.jaxprs: dict[tuple[int, int], Any] = {}  # (id full, id small) -> the jaxpr at batch / count
        self.kept: list[Any] = []  # the keys' objects, alive while their ids are keys

    def number(self, a: Any, b: Any) -> Any:
        if isinstance(a, (bool, np.bool_)) or isinstance(b, (bool, np.bool_)):
            if a != b:
                raise _Differs(f"a flag differs: {a!r} and {b!r}")
            return a
        if a == b:
            return a
        if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
            if a == b * self.ratio and a % self.count == 0:
                return type(a)(a // self.count)
            if b == a * self.ratio:
                return type(a)(a * self.count)
            raise _Differs(f"{a} at the full batch and {b} at batch / {self.ratio}: not proportional")
        fa, fb = float(a), float(b)
        if math.isfinite(fa) and math.isfinite(fb) and fa != 0 and fb != 0:
            if math.isclose(fa, fb * self.ratio, rel_tol=1e-6):
                return _like(a, fa / self.count)
            if math.isclose(fb, fa * self.ratio, rel_tol=1e-6):
                return _like(a, fa * self.count)
        raise _Differs(f"{a!r} at the full batch and {b!r} at batch / {self.ratio}: not proportional")

    def shape(self, a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
        if len(a) != len(b):
            raise _Differs(f"ranks differ: {a} and {b}")
        return tuple(self.number(x, y) for x, y in zip(a, b))

    def aval(self, a: Any, b: Any) -> Any:
        if a == b:
            return a
        if type(a) is not type(b) or not hasattr(a, "shape") or getattr(a, "dtype", None) != getattr(b, "dtype", None):
            raise _Differs(f"values differ: {a} and {b}")
        return a.update(shape=self.shape(a.shape, b.shape))

    def var(self, a: Any, b: Any) -> Any:
        if isinstance(a, jcore.Literal):
            if not isinstance(b, jcore.Literal):
                raise _Differs("a literal against a variable")
            aval = self.aval(a.aval, b.aval)
            val = self.value(a.val, b.val)
            return a if val is a.val and aval is a.aval else jcore.Literal(val, aval)
        if isinstance(a, jax_core.DropVar):
            return jax_core.DropVar(self.aval(a.aval, b.aval))
        if a not in self.vars:
            aval = self.aval(a.aval, b.aval)
            self.vars[a] = a if aval is a.aval else jcore.Var(aval)
        return self.vars[a]

    def value(self, a: Any, b: Any) -> Any:
        """A parameter or literal value at batch / count."""
        if a is b:
            return a
        if isinstance(a, (jcore.ClosedJaxpr, jcore.Jaxpr)):
            if type(b) is not type(a):
                raise _Differs("a jaxpr against another value")
            return self.closed(a, b) if isinstance(a, jcore.ClosedJaxpr) else self.jaxpr(a, b)
        if isinstance(a, (tuple, list)):
            if type(b) is not type(a) or len(a) != len(b):
                raise _Differs(f"parameters differ: {a!r} and {b!r}")
            out = [self.value(x, y) for x, y in zip(a, b)]
            return a if all(x is y for x, y in zip(out, a)) else type(a)(out)
        if isinstance(a, (int, float, np.integer, np.floating, np.bool_, bool)):
            return self.number(a, b)
        if isinstance(a, np.ndarray) or hasattr(a, "__array__") and hasattr(a, "shape"):
            x, y = np.asarray(a), np.asarray(b)
            if x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y):
                return a
            if x.shape == () and y.shape == ():
                return np.asarray(self.number(x.item(), y.item()), dtype=x.dtype)
            raise _Differs(f"constant arrays differ: {x.shape} and {y.shape}")
        if hasattr(a, "shape") and hasattr(a, "dtype") and hasattr(a, "update"):  # an abstract value
            return self.aval(a, b)
        try:
            same = bool(a == b)
        except Exception:  # noqa: BLE001 — an object without equality is opaque
            same = False
        if not same:
            raise _Differs(f"parameters differ: {a!r} and {b!r}")
        return a

    def rule(self, a: Any, b: Any) -> Any:
        """A custom_jvp_call's rule (a thunk: which tangents are zero -> the JVP's jaxpr, consts and zero outputs),
        traced by jax at its call's shapes: the rule at batch / count extrapolates the rule's jaxprs at both.
        Checked here on nonzero tangents (the case a gradient traces); other cases are extrapolated when asked."""
        if a is b:
            return a
        if not isinstance(a, lu.WrappedFun) or not isinstance(b, lu.WrappedFun):
            raise _Differs(f"a custom_jvp rule differs: {a!r} and {b!r}")
        ratio, count = self.ratio, self.count
        cache: dict[tuple[bool, ...], Any] = {}

        def at_count(*in_zeros: bool) -> Any:
            if in_zeros not in cache:
                ja, ca, za = a.call_wrapped(*in_zeros)
                jb, cb, zb = b.call_wrapped(*in_zeros)
                scaler = _Scaler(ratio, count, check_rules=False)
                if za != zb:
                    raise _Differs("a custom_jvp rule's zero outputs differ")
                cache[in_zeros] = (scaler.jaxpr(ja, jb), [scaler.value(x, y) for x, y in zip(ca, cb, strict=True)], za)
            return cache[in_zeros]

        return lu.wrap_init(at_count, debug_info=a.debug_info)

    def jaxpr(self, a: Any, b: Any) -> Any:
        key = (id(a), id(b))
        if key not in self.jaxprs:  # a shared body (a jit called twice) stays one object
            self.kept.append((a, b))
            self.jaxprs[key] = self._jaxpr(a, b)
        return self.jaxprs[key]

    def _jaxpr(self, a: Any, b: Any) -> Any:
        if len(a.eqns) != len(b.eqns) or len(a.invars) != len(b.invars) or len(a.outvars) != len(b.outvars) \
                or len(a.constvars) != len(b.constvars):
            raise _Differs("the jaxprs have other equations")
        constvars = [self.var(x, y) for x, y in zip(a.constvars, b.constvars)]
        invars = [self.var(x, y) for x, y in zip(a.invars, b.invars)]
        eqns = []
        for ea, eb in zip(a.eqns, b.eqns):
            if ea.primitive is not eb.primitive or set(ea.params) != set(eb.params):
                raise _Differs(f"{ea.primitive} against {eb.primitive}")
            ins = [self.var(x, y) for x, y in zip(ea.invars, eb.invars, strict=True)]
            params = {k: self.rule(v, eb.params[k]) if k == "jvp_jaxpr_fun" else self.value(v, eb.params[k])
                      for k, v in ea.params.items()}
            outs = [self.var(x, y) for x, y in zip(ea.outvars, eb.outvars, strict=True)]
            if self.check_rules and params.get("jvp_jaxpr_fun", None) is not ea.params.get("jvp_jaxpr_fun", None):
                nonzero = (False,) * (len(ins) - int(params.get("num_consts", 0)))
                params["jvp_jaxpr_fun"].call_wrapped(*nonzero)  # the gradient's case, checked now
            eqns.append(ea.replace(invars=ins, outvars=outs, params=params))
        outvars = [self.var(x, y) for x, y in zip(a.outvars, b.outvars)]
        return a.replace(constvars=constvars, invars=invars, outvars=outvars, eqns=eqns)

    def closed(self, a: jcore.ClosedJaxpr, b: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
        key = (id(a), id(b))
        if key not in self.jaxprs:
            self.kept.append((a, b))
            self.jaxprs[key] = self._closed(a, b)
        return self.jaxprs[key]

    def _closed(self, a: jcore.ClosedJaxpr, b: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
        consts = [self.value(x, y) for x, y in zip(a.consts, b.consts, strict=True)]
        return jcore.ClosedJaxpr(self.jaxpr(a.jaxpr, b.jaxpr), consts)


def _like(a: Any, value: float) -> Any:
    """``value`` with the type of the number ``a``."""
    if isinstance(a, np.generic):
        return a.dtype.type(value)
    return type(a)(value)


def extrapolate(full: jcore.ClosedJaxpr, small: jcore.ClosedJaxpr, ratio: int, count: int) -> jcore.ClosedJaxpr | None:
    """The jaxpr at batch / ``count``, from ``full`` (traced at the full batch) and ``small`` (at batch /
    ``ratio``); None when they differ in a way no batch size explains, or the result does not type-check."""
    if ratio <= 1 or count < 1:
        raise ValueError(f"ratio must be > 1 and count >= 1; got {ratio} and {count}")
    try:
        out = _Scaler(ratio, count).closed(full, small)
    except Exception as err:  # noqa: BLE001 — _Differs, or a jax error from a rule's trace: traced instead
        log.info("the step's jaxpr at batch / %d is not extrapolated: %s", count, err)
        return None
    try:
        jax_core.check_jaxpr(out.jaxpr)
    except Exception as err:  # noqa: BLE001 — jax's type error, reported and traced instead
        log.info("the step's jaxpr extrapolated to batch / %d does not type-check: %s", count, err)
        return None
    return out
