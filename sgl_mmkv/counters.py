"""The base of sgl_mmkv's server-wide counter sets."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(slots=True)
class Counters:
    """Monotonic counts since start; subclasses declare their fields."""

    def as_dict(self) -> dict[str, int | float]:
        """``{field: value}`` in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
