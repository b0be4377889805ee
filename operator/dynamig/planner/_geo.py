"""Memoised geometry queries for one planning round.

The planner asks the same questions many times (where can profile P go on a GPU whose layout is L?): there
are thousands of GPUs but only a few hundred distinct layouts per model, so every answer is cached by
(model key, layout). The cache lives in a ``GeoCache`` object created per planning call, never in a module
global, so two calls never share state. Pure: every method's result depends only on its arguments and the
catalog.
"""

from __future__ import annotations

from dynamig.geometry.catalog import Catalog
from dynamig.geometry.layout import check_layout, free_starts
from dynamig.geometry.model import GpuModel, Layout, PlacedInstance


class GeoCache:
    """Cached ``free_starts``/``check_layout`` answers and layout scores for one catalog."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._models: dict[str, GpuModel] = {}
        self._free: dict[tuple[str, Layout, str], tuple[int, ...]] = {}
        self._valid: dict[tuple[str, Layout], bool] = {}
        self._flex: dict[tuple[str, Layout, frozenset[str] | None], tuple[int, int]] = {}
        self._used: dict[tuple[str, Layout], int] = {}

    def model(self, key: str) -> GpuModel:
        try:
            return self._models[key]
        except KeyError:
            model = self.catalog.model(key)
            self._models[key] = model
            return model

    def free_starts(self, model: GpuModel, layout: Layout, profile: str) -> tuple[int, ...]:
        """Starts at which one more ``profile`` instance can be added to ``layout`` (all rules checked)."""
        k = (model.key, layout, profile)
        got = self._free.get(k)
        if got is None:
            got = tuple(free_starts(model, layout, profile))
            self._free[k] = got
        return got

    def is_valid(self, model: GpuModel, layout: Layout) -> bool:
        k = (model.key, layout)
        got = self._valid.get(k)
        if got is None:
            got = check_layout(model, layout) is None
            self._valid[k] = got
        return got

    def used_slices(self, model: GpuModel, layout: Layout) -> int:
        """Memory slices covered by the instances of ``layout``."""
        k = (model.key, layout)
        got = self._used.get(k)
        if got is None:
            mask = 0
            for inst in layout:
                p = model.profile(inst.profile)
                mask |= ((1 << p.placement_size) - 1) << inst.start
            got = mask.bit_count()
            self._used[k] = got
        return got

    def flex(self, model: GpuModel, layout: Layout, allowed: frozenset[str] | None) -> tuple[int, int]:
        """How much room ``layout`` leaves: (largest placement size still creatable, creatable placements).

        Higher is better: a layout that can still take a large profile, or many placements, is less
        fragmented.
        """
        k = (model.key, layout, allowed)
        got = self._flex.get(k)
        if got is None:
            largest = 0
            count = 0
            for p in model.profiles:
                if allowed is not None and p.name not in allowed:
                    continue
                n = len(self.free_starts(model, layout, p.name))
                if n:
                    count += n
                    largest = max(largest, p.placement_size)
            got = (largest, count)
            self._flex[k] = got
        return got


def with_instance(layout: Layout, inst: PlacedInstance) -> Layout:
    """``layout`` plus ``inst``, kept sorted (layouts are tiny, so a sort is cheapest)."""
    return tuple(sorted((*layout, inst)))


def without(layout: Layout, drop: tuple[PlacedInstance, ...]) -> Layout:
    if not drop:
        return layout
    return tuple(i for i in layout if i not in drop)
