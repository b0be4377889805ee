"""Memoised geometry queries for one planning round.

The planner asks the same questions many times (where can profile P go on a GPU whose layout is L?): there
are thousands of GPUs but only a few hundred distinct layouts per model, so every answer is cached by
(model key, layout). The cache lives in a ``GeoCache`` object created per planning call, never in a module
global, so two calls never share state. Pure: every method's result depends only on its arguments and the
catalog.
"""

from __future__ import annotations

from dynamig.geometry.catalog import Catalog
from dynamig.geometry.layout import check_layout, free_starts, remaining_capacity
from dynamig.geometry.model import GpuModel, Layout, PlacedInstance


class GeoCache:
    """Cached ``free_starts``/``check_layout`` answers and layout scores for one catalog."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._models: dict[str, GpuModel] = {}
        self._free: dict[tuple[str, Layout, str], tuple[int, ...]] = {}
        self._valid: dict[tuple[str, Layout], bool] = {}
        self._flex: dict[tuple[str, Layout, frozenset[str] | None, bool], tuple[int, ...]] = {}
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

    def flex(
        self, model: GpuModel, layout: Layout, allowed: frozenset[str] | None, capacity: bool = False
    ) -> tuple[int, ...]:
        """How much room ``layout`` leaves, as a key where smaller is better (less fragmented).

        Default: (free memory slices that no creatable placement covers any more, minus the largest
        creatable placement size, minus the number of creatable (profile, start) pairs).

        ``capacity``: for each creatable profile, largest placement first, minus how many more instances of
        it still fit (NVML's remaining capacity), then minus the number of creatable (profile, start)
        pairs. Comparing keys lexicographically prefers layouts that keep large free regions.
        """
        k = (model.key, layout, allowed, capacity)
        got = self._flex.get(k)
        if got is None and not capacity:
            largest = 0
            count = 0
            covered = 0
            for p in model.profiles:
                if allowed is not None and p.name not in allowed:
                    continue
                starts = self.free_starts(model, layout, p.name)
                if starts:
                    count += len(starts)
                    largest = max(largest, p.placement_size)
                    for s in starts:
                        covered |= p.mask(s)
            free = model.memory_slices - self.used_slices(model, layout)
            got = (free - covered.bit_count(), -largest, -count)
            self._flex[k] = got
        elif got is None:
            profiles = sorted(
                (p for p in model.profiles if allowed is None or p.name in allowed),
                key=lambda p: (-p.placement_size, -p.memory_mib, p.name),
            )
            key: list[int] = []
            placements = 0
            for p in profiles:
                starts = self.free_starts(model, layout, p.name)
                placements += len(starts)
                key.append(-remaining_capacity(model, layout, p.name) if starts else 0)
            key.append(-placements)
            got = tuple(key)
            self._flex[k] = got
        return got


def with_instance(layout: Layout, inst: PlacedInstance) -> Layout:
    """``layout`` plus ``inst``, kept sorted (layouts are tiny, so a sort is cheapest)."""
    return tuple(sorted((*layout, inst)))


def without(layout: Layout, drop: tuple[PlacedInstance, ...]) -> Layout:
    if not drop:
        return layout
    return tuple(i for i in layout if i not in drop)
