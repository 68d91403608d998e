"""A mixin for plain-data types kept as JSON files: ``save`` and ``load`` from ``to_dict``/``from_dict``."""

from __future__ import annotations

import json
from os import PathLike
from typing import Any, TypeVar

T = TypeVar("T", bound="JsonFile")


def write_json(path: str | PathLike[str], value: Any) -> None:
    """Write ``value`` to ``path`` as JSON (``dumps`` then one write: far faster than ``dump``
    for large values such as long timelines)."""
    with open(path, "w", encoding="utf-8") as file:
        file.write(json.dumps(value))


class JsonFile:
    """Adds :meth:`save` and :meth:`load` to a class with ``to_dict`` and ``from_dict``."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary (defined by the subclass)."""
        raise NotImplementedError

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        """The inverse of :meth:`to_dict` (defined by the subclass)."""
        raise NotImplementedError

    def save(self, path: str | PathLike[str]) -> None:
        """Write ``to_dict()`` to ``path`` as JSON."""
        write_json(path, self.to_dict())

    @classmethod
    def load(cls: type[T], path: str | PathLike[str]) -> T:
        """Read what :meth:`save` wrote."""
        with open(path, encoding="utf-8") as file:
            return cls.from_dict(json.load(file))
