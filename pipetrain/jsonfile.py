"""Plain-data types kept as JSON files.

:class:`JsonFile` adds ``save`` and ``load`` to a type with ``to_dict``/``from_dict``;
:func:`versioned` and :func:`unversioned` write and check the ``format_version`` that every
such file carries, so that a file from another pipetrain is refused with a clear message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from os import PathLike
from typing import Any, TypeVar

T = TypeVar("T", bound="JsonFile")

_VERSION_KEY = "format_version"


def write_json(path: str | PathLike[str], value: object) -> None:
    """Write ``value`` to ``path`` as JSON (``dumps`` then one write: far faster than ``dump``
    for large values such as long timelines)."""
    with open(path, "w", encoding="utf-8") as file:
        file.write(json.dumps(value))


def versioned(version: int, fields: Mapping[str, Any]) -> dict[str, Any]:
    """``fields`` preceded by ``"format_version": version``."""
    return {_VERSION_KEY: version, **fields}


def unversioned(
    data: object, what: str, version: int, advice: str = "", *, default: int | None = None
) -> dict[str, Any]:
    """The fields of ``data`` other than its ``format_version``, once ``data`` is known to be
    a JSON object in format ``version``.

    ``what`` names the kind of file (``"profile"``) and ``advice`` (a sentence) tells the
    reader what to do about a file in another format. ``default`` is the version assumed
    when ``data`` has none; without it the version is required. Raises ValueError.
    """
    if not isinstance(data, dict):
        raise ValueError(f"a {what} must be a JSON object, got {type(data).__name__}")
    found = data.get(_VERSION_KEY, default)
    if found != version:
        raise ValueError(
            f"{what} format_version {found!r} is not supported; this pipetrain reads "
            f"format_version {version}. {advice}".rstrip()
        )
    return {key: value for key, value in data.items() if key != _VERSION_KEY}


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
        """Read what :meth:`save` wrote.

        Raises:
            ValueError: naming ``path``, when it cannot be read, is not JSON (a truncated
                file) or does not hold this type.
        """
        what = cls.__name__.lower()
        try:
            with open(path, encoding="utf-8") as file:
                text = file.read()
        except OSError as error:
            raise ValueError(f"cannot read the {what} {path}: {error.strerror or error}") from error
        except UnicodeDecodeError as error:
            raise ValueError(f"the {what} {path} is not UTF-8 text: {error.reason}") from error
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"the {what} {path} is not valid JSON ({error}); is the file complete?"
            ) from error
        except RecursionError:
            # the decoder recurses once per nested array or object
            raise ValueError(
                f"the {what} {path} nests its JSON too deeply to be a {what}"
            ) from None
        try:
            return cls.from_dict(data)
        except (ValueError, KeyError, TypeError) as error:
            detail = (
                str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
            )
            raise ValueError(f"the {what} {path} cannot be used: {detail}") from error
