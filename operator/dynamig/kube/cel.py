"""Kubernetes DRA CEL selectors evaluated with a real CEL implementation (cel-python, ``celpy``).

The scheduler decides whether a device satisfies a request by evaluating the request's CEL selectors and its
DeviceClass's selectors against the device as the ``device`` variable. The operator has to answer the same
question *before* the device exists ("which MIG profile would satisfy this claim?"), so it evaluates the very
same expressions against the ``MigDevice`` each profile would be published as.

What the environment provides, following the Kubernetes DRA CEL environment:

- ``device.driver`` (string), ``device.attributes["<domain>"].<name>`` and
  ``device.capacity["<domain>"].<name>``.
  An unknown domain is an empty map (as in Kubernetes), an unknown name inside a domain is a runtime error.
  Capacity values are Kubernetes quantities.
- The Kubernetes quantity library: ``quantity(s)``, ``isQuantity(s)``, and on quantities ``compareTo``,
  ``isGreaterThan``, ``isLessThan``, ``add``, ``sub``, ``sign``, ``isInteger``, ``asInteger``,
  ``asApproximateFloat``; ``==``/``!=`` compare quantities by value.

A runtime error (missing attribute, wrong types) means "this device does not match"; the error text is kept so
that a claim nobody can satisfy can be told why. Compiled programs are cached per expression.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any

import celpy
from celpy import celtypes

from dynamig.kube.devices import MigDevice
from dynamig.kube.names import ATTRIBUTE_DOMAIN

__all__ = [
    "CelError",
    "DeviceView",
    "Quantity",
    "SelectorResult",
    "compile_selector",
    "device_view",
    "evaluate_selector",
    "parse_quantity",
]

# --------------------------------------------------------------------------------------------- quantities

_BINARY_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL_SUFFIX = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
_QUANTITY_RE = re.compile(
    r"^([+-]?)(\d+(?:\.\d*)?|\.\d+)(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?$"
)


class CelError(ValueError):
    """A selector that does not compile, or a bad argument to a Kubernetes CEL library function."""


@dataclass(frozen=True, slots=True)
class Quantity:
    """A Kubernetes ``resource.Quantity`` held as an exact fraction. Pure value."""

    value: Fraction
    text: str = ""

    def __str__(self) -> str:
        return self.text or str(self.value)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Quantity):
            return self.value == other.value
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.value)


def parse_quantity(text: str) -> Quantity:
    """Parse Kubernetes quantity syntax (``10Gi``, ``500m``, ``1.5G``, ``1e3``). Pure.

    CelError if ``text`` is malformed.
    """
    match = _QUANTITY_RE.match(text.strip())
    if not match:
        raise CelError(f"quantities must match the regular expression for a Kubernetes quantity: {text!r}")
    sign, number, exponent, suffix = match.groups()
    value = Fraction(number)
    if exponent:
        value *= Fraction(10) ** int(exponent[1:])
    elif suffix in _BINARY_SUFFIX:
        value *= _BINARY_SUFFIX[suffix]
    else:
        value *= _DECIMAL_SUFFIX[suffix or ""]
    if sign == "-":
        value = -value
    return Quantity(value, text)


def _as_quantity(value: Any, function: str) -> Quantity:
    if isinstance(value, Quantity):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return Quantity(Fraction(int(value)))
    raise TypeError(f"{function}: expected a quantity, got {type(value).__name__}")


def _cmp(a: Fraction, b: Fraction) -> int:
    return (a > b) - (a < b)


def _fn_quantity(text: Any) -> Quantity:
    if not isinstance(text, str):
        raise TypeError("quantity() takes a string")
    try:
        return parse_quantity(str(text))
    except CelError as exc:
        # celpy turns ValueError into an evaluation error, which is what Kubernetes does too
        raise ValueError(str(exc)) from None


def _fn_is_quantity(text: Any) -> celtypes.BoolType:
    try:
        parse_quantity(str(text))
    except CelError:
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


def _fn_compare_to(a: Any, b: Any) -> celtypes.IntType:
    return celtypes.IntType(_cmp(_as_quantity(a, "compareTo").value, _as_quantity(b, "compareTo").value))


def _fn_is_greater(a: Any, b: Any) -> celtypes.BoolType:
    return celtypes.BoolType(_as_quantity(a, "isGreaterThan").value > _as_quantity(b, "isGreaterThan").value)


def _fn_is_less(a: Any, b: Any) -> celtypes.BoolType:
    return celtypes.BoolType(_as_quantity(a, "isLessThan").value < _as_quantity(b, "isLessThan").value)


def _fn_add(a: Any, b: Any) -> Quantity:
    return Quantity(_as_quantity(a, "add").value + _as_quantity(b, "add").value)


def _fn_sub(a: Any, b: Any) -> Quantity:
    return Quantity(_as_quantity(a, "sub").value - _as_quantity(b, "sub").value)


def _fn_sign(a: Any) -> celtypes.IntType:
    return celtypes.IntType(_cmp(_as_quantity(a, "sign").value, Fraction(0)))


def _fn_is_integer(a: Any) -> celtypes.BoolType:
    q = _as_quantity(a, "isInteger").value
    return celtypes.BoolType(q.denominator == 1 and -(2**63) <= q <= 2**63 - 1)


def _fn_as_integer(a: Any) -> celtypes.IntType:
    q = _as_quantity(a, "asInteger").value
    if q.denominator != 1 or not -(2**63) <= q <= 2**63 - 1:
        raise ValueError("cannot convert value to integer")
    return celtypes.IntType(int(q))


def _fn_as_float(a: Any) -> celtypes.DoubleType:
    return celtypes.DoubleType(float(_as_quantity(a, "asApproximateFloat").value))


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "quantity": _fn_quantity,
    "isQuantity": _fn_is_quantity,
    "compareTo": _fn_compare_to,
    "isGreaterThan": _fn_is_greater,
    "isLessThan": _fn_is_less,
    "add": _fn_add,
    "sub": _fn_sub,
    "sign": _fn_sign,
    "isInteger": _fn_is_integer,
    "asInteger": _fn_as_integer,
    "asApproximateFloat": _fn_as_float,
}

# --------------------------------------------------------------------------------------------- the device


class _DomainMap(celtypes.MapType):  # type: ignore[misc]
    """``device.attributes`` / ``device.capacity``: an unknown domain reads as an empty map."""

    def __getitem__(self, key: Any) -> Any:
        if super().__contains__(key):
            return super().__getitem__(key)
        return celtypes.MapType({})


@dataclass(frozen=True, slots=True)
class DeviceView:
    """What a selector sees as ``device``: driver, attributes and capacity keyed by domain. Pure value."""

    driver: str
    attributes: Mapping[str, Mapping[str, str | int | bool]]
    capacity: Mapping[str, Mapping[str, Quantity]]

    def activation(self) -> dict[str, Any]:
        attrs = _DomainMap(
            {
                celtypes.StringType(domain): celtypes.MapType(
                    {celtypes.StringType(k): _cel_value(v) for k, v in values.items()}
                )
                for domain, values in self.attributes.items()
            }
        )
        caps = _DomainMap(
            {
                celtypes.StringType(domain): celtypes.MapType(
                    {celtypes.StringType(k): v for k, v in values.items()}
                )
                for domain, values in self.capacity.items()
            }
        )
        device = celtypes.MapType(
            {
                celtypes.StringType("driver"): celtypes.StringType(self.driver),
                celtypes.StringType("attributes"): attrs,
                celtypes.StringType("capacity"): caps,
            }
        )
        return {"device": device}


def _cel_value(value: str | int | bool) -> Any:
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if isinstance(value, int):
        return celtypes.IntType(value)
    return celtypes.StringType(value)


def device_view(device: MigDevice, driver: str = ATTRIBUTE_DOMAIN) -> DeviceView:
    """The ``device`` a selector sees for ``device`` as the agent would publish it. Pure."""
    return DeviceView(
        driver=driver,
        attributes={ATTRIBUTE_DOMAIN: dict(device.attributes())},
        capacity={ATTRIBUTE_DOMAIN: {k: Quantity(Fraction(v), str(v)) for k, v in device.capacity().items()}},
    )


def device_view_from_api(driver: str, device: Mapping[str, Any]) -> DeviceView:
    """A ``DeviceView`` from a resource.k8s.io/v1 ``Device`` dict (as published in a ResourceSlice). Pure.

    Attribute and capacity names without a domain belong to the driver's domain, as in Kubernetes.
    """
    attributes: dict[str, dict[str, str | int | bool]] = {}
    for key, typed in (device.get("attributes") or {}).items():
        domain, _, name = key.rpartition("/")
        value: str | int | bool
        if "int" in typed:
            value = int(typed["int"])
        elif "bool" in typed:
            value = bool(typed["bool"])
        else:
            value = str(typed.get("string", typed.get("version", "")))
        attributes.setdefault(domain or driver, {})[name] = value
    capacity: dict[str, dict[str, Quantity]] = {}
    for key, cap in (device.get("capacity") or {}).items():
        domain, _, name = key.rpartition("/")
        capacity.setdefault(domain or driver, {})[name] = parse_quantity(str(cap["value"]))
    return DeviceView(driver=driver, attributes=attributes, capacity=capacity)


# --------------------------------------------------------------------------------------------- evaluation


@dataclass(frozen=True, slots=True)
class SelectorResult:
    """Outcome of one selector on one device: ``matched``, or ``error`` text when evaluation failed."""

    matched: bool
    error: str = ""


_ENV = celpy.Environment()


@lru_cache(maxsize=1024)
def compile_selector(expression: str) -> Any:
    """Compile ``expression`` once (cached). CelError naming the expression if it does not parse."""
    try:
        ast = _ENV.compile(expression)
    except celpy.CELParseError as exc:
        raise CelError(f"selector {expression!r} does not compile: {exc}") from None
    return _ENV.program(ast, functions=_FUNCTIONS)


def _eval_error_text(exc: Exception) -> str:
    """celpy errors carry (message, cause class, cause args); keep the cause's words when there are any."""
    args = exc.args
    message = str(args[0]) if args else str(exc)
    cause_args = args[2] if len(args) > 2 and isinstance(args[2], tuple) else ()
    if cause_args:
        message = f"{message}: {'; '.join(str(a) for a in cause_args)}"
    return message


def evaluate_selector(expression: str, device: DeviceView) -> SelectorResult:
    """Evaluate one CEL selector on one device. Pure (apart from the compile cache).

    Like the scheduler, only a boolean ``true`` matches; a non-boolean result or a runtime error does not.
    """
    try:
        program = compile_selector(expression)
    except CelError as exc:
        return SelectorResult(False, str(exc))
    try:
        result = program.evaluate(device.activation())
    except celpy.CELEvalError as exc:
        return SelectorResult(False, f"selector {expression!r} failed: {_eval_error_text(exc)}")
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        return SelectorResult(False, f"selector {expression!r} failed: {exc}")
    if isinstance(result, celtypes.BoolType):
        return SelectorResult(bool(result))
    if isinstance(result, bool):
        return SelectorResult(result)
    return SelectorResult(False, f"selector {expression!r} returned {type(result).__name__}, not bool")
