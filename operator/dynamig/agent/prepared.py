"""The devices the kubelet plugin prepared, counted per claim: :class:`PreparedDevices`.

One instance can be prepared for several claims at once (an ordinary claim and an ``adminAccess`` claim that
monitors it). Unpreparing one of them must not make the instance look free while the other still uses it,
so each prepare counts once and each release takes one count away; the device is prepared while any count
is left. Side effects: none (in-memory state shared by the agent's round and its kubelet plugin).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Set


class PreparedDevices(Set[str]):
    """A multiset of device names that reads like the set of devices prepared for at least one claim."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._counts: Counter[str] = Counter()
        self.update(names)

    def add(self, name: str) -> None:
        """One more claim prepared ``name``."""
        self._counts[name] += 1

    def update(self, names: Iterable[str]) -> None:
        """One more claim prepared each of ``names`` (a name listed twice counts twice)."""
        for name in names:
            self.add(name)

    def reset(self, names: Iterable[str]) -> None:
        """Count exactly ``names`` (one per claim that prepared it), as the plugin's checkpoint holds them
        when it starts: it is the only one that prepares, so its checkpoint is the whole truth then."""
        self._counts.clear()
        self.update(names)

    def discard(self, name: str) -> None:
        """One claim using ``name`` was unprepared; the device stays prepared while others use it."""
        left = self._counts[name] - 1
        if left > 0:
            self._counts[name] = left
        else:
            self._counts.pop(name, None)

    def claims(self, name: str) -> int:
        """How many prepared claims use ``name``."""
        return self._counts.get(name, 0)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._counts.get(name, 0) > 0

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._counts))

    def __len__(self) -> int:
        return len(self._counts)

    def __repr__(self) -> str:
        return f"PreparedDevices({dict(self._counts)!r})"
