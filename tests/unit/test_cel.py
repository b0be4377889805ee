"""DRA CEL selectors evaluated by the operator.

Real: the CEL implementation (cel-python) parses and evaluates every expression; the devices are built by the
same ``MigDevice`` builder the agent publishes with, from the real MIG geometry catalog. Nothing is simulated.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from dynamig.geometry.catalog import load_catalog
from dynamig.geometry.model import GpuModel
from dynamig.kube.cel import (
    CelError,
    DeviceView,
    compile_selector,
    device_view,
    device_view_from_api,
    evaluate_selector,
    parse_quantity,
)
from dynamig.kube.devices import MigDevice

PROFILE = 'device.attributes["mig.dynamig.io"].profile'
MEMORY = 'device.capacity["mig.dynamig.io"].memory'


def a100() -> GpuModel:
    return load_catalog().model("A100-80GB")


def view(model: GpuModel, profile: str, start: int | None = None) -> DeviceView:
    p = model.profile(profile)
    return device_view(
        MigDevice(0, p, p.placement_starts[0] if start is None else start, model.product_name, "GPU-1234")
    )


def selected(model: GpuModel, expression: str) -> list[str]:
    return [p.name for p in model.profiles if evaluate_selector(expression, view(model, p.name)).matched]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("10Gi", 10 * 2**30),
        ("9728Mi", 9728 * 2**20),
        ("1.5G", 1_500_000_000),
        ("500m", Fraction(1, 2)),
        ("1e3", 1000),
        ("-2Ki", -2048),
        ("0", 0),
        (".5", Fraction(1, 2)),
    ],
)
def test_quantity_parsing_follows_kubernetes_suffixes(text: str, value: int | Fraction) -> None:
    assert parse_quantity(text).value == value


@pytest.mark.parametrize("text", ["", "10 Gi", "Gi", "1.2.3", "10gi", "abc"])
def test_malformed_quantity_is_refused(text: str) -> None:
    with pytest.raises(CelError):
        parse_quantity(text)


def test_profile_selector_picks_exactly_that_profile() -> None:
    assert selected(a100(), f'{PROFILE} == "1g.10gb"') == ["1g.10gb"]
    assert selected(a100(), f'{PROFILE} in ["2g.20gb", "3g.40gb"]') == ["2g.20gb", "3g.40gb"]


def test_capacity_compare_to_quantity_uses_catalog_memory() -> None:
    model = a100()
    expr = f'{MEMORY}.compareTo(quantity("20Gi")) >= 0'
    expected = [p.name for p in model.profiles if p.memory_mib * 2**20 >= 20 * 2**30]
    assert selected(model, expr) == expected
    # 2g.20gb publishes 19.5 GiB: a "20Gi" request must not take it
    assert "2g.20gb" not in expected and "3g.40gb" in expected


def test_is_greater_and_is_less_than() -> None:
    model = a100()
    between = f'{MEMORY}.isGreaterThan(quantity("15Gi")) && {MEMORY}.isLessThan(quantity("30Gi"))'
    assert selected(model, between) == ["1g.20gb", "2g.20gb"]


def test_quantity_library_arithmetic_and_conversions() -> None:
    dev = view(a100(), "1g.10gb")
    for expr in (
        f'{MEMORY} == quantity("9728Mi")',
        f'{MEMORY}.add(quantity("256Mi")) == quantity("9984Mi")',
        f'{MEMORY}.sub(quantity("9728Mi")).sign() == 0',
        f"{MEMORY}.asInteger() == {9728 * 2**20}",
        f"{MEMORY}.isInteger()",
        'quantity("500m").asApproximateFloat() == 0.5',
        'isQuantity("10Gi") && !isQuantity("ten")',
        'device.capacity["mig.dynamig.io"].multiprocessors.compareTo(quantity("14")) == 0',
    ):
        assert evaluate_selector(expr, dev).matched, expr


def test_driver_and_other_attributes() -> None:
    model = a100()
    assert selected(model, 'device.driver == "mig.dynamig.io"') == [p.name for p in model.profiles]
    assert selected(model, 'device.driver == "gpu.nvidia.com"') == []
    assert selected(model, 'device.attributes["mig.dynamig.io"].computeSlices >= 4') == ["4g.40gb", "7g.80gb"]
    assert selected(model, 'device.attributes["mig.dynamig.io"].productName.matches("A100.*80GB")') == [
        p.name for p in model.profiles
    ]


def test_unknown_domain_is_empty_but_unknown_name_is_an_error() -> None:
    dev = view(a100(), "1g.10gb")
    assert evaluate_selector('!("model" in device.attributes["gpu.nvidia.com"])', dev).matched
    result = evaluate_selector('device.attributes["mig.dynamig.io"].nope == "x"', dev)
    assert not result.matched
    assert "nope" in result.error


def test_non_boolean_result_and_syntax_error_do_not_match() -> None:
    dev = view(a100(), "1g.10gb")
    result = evaluate_selector(PROFILE, dev)
    assert not result.matched and "not bool" in result.error
    bad = evaluate_selector(f"{PROFILE} ==", dev)
    assert not bad.matched and "does not compile" in bad.error
    with pytest.raises(CelError):
        compile_selector("device.(")


def test_profile_names_differ_per_model() -> None:
    # 1g.10gb is a 1-slice profile on A100-80GB and a 2-slice one on A100-40GB: selectors on computeSlices and
    # memory see each model's own device
    a40 = load_catalog().model("A100-40GB")
    size = 'device.attributes["mig.dynamig.io"].placementSize == 2'
    assert "1g.10gb" in selected(a40, f'{PROFILE} == "1g.10gb" && {size}')
    assert selected(a100(), f'{PROFILE} == "1g.10gb" && {size}') == []


def test_view_from_published_device_matches_view_of_planned_device() -> None:
    model = a100()
    device = MigDevice(1, model.profile("3g.40gb"), 4, model.product_name, "GPU-abcd", uuid="MIG-1")
    published = device_view_from_api("mig.dynamig.io", device.to_api())
    planned = device_view(device)
    for expr in (
        f'{PROFILE} == "3g.40gb"',
        'device.attributes["mig.dynamig.io"].gpuIndex == 1',
        'device.attributes["mig.dynamig.io"].placementStart == 4',
        f'{MEMORY}.compareTo(quantity("39Gi")) > 0',
    ):
        assert evaluate_selector(expr, published).matched
        assert evaluate_selector(expr, planned).matched
