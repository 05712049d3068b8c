"""Typed reading of one TOML table, with errors that name the dotted key.

:class:`Table` wraps a mapping and hands out checked values (``table.int("port", 8000, minimum=0)``);
every key read is remembered, and :meth:`Table.finish` rejects the ones never read, suggesting the
closest known name. The policy module builds its dataclasses from these readers and nothing else
knows TOML.
"""

from __future__ import annotations

import difflib
from enum import StrEnum
from typing import Any, Mapping, TypeVar

E = TypeVar("E", bound=StrEnum)


class PolicyError(ValueError):
    """A policy file that cannot be used; ``key`` is the dotted key at fault ("" for the whole file)."""

    def __init__(self, key: str, problem: str, *, source: str = "") -> None:
        self.key = key
        self.problem = problem
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{key}: {problem}" if key else f"{where}{problem}")


def _describe(value: object) -> str:
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "table"}
    return f"{kind.get(type(value), type(value).__name__)} {value!r}"


class Table:
    """One TOML table at a dotted ``path`` ("" for the top level)."""

    def __init__(self, data: object, path: str, source: str) -> None:
        if not isinstance(data, Mapping):
            raise PolicyError(path, f"expected a table, got {_describe(data)}", source=source)
        self._data = data
        self._path = path
        self._source = source
        self._known: list[str] = []

    def key(self, name: str) -> str:
        return f"{self._path}.{name}" if self._path else name

    def error(self, name: str, problem: str) -> PolicyError:
        return PolicyError(self.key(name), problem, source=self._source)

    def has(self, name: str) -> bool:
        self._known.append(name)
        return name in self._data

    def raw(self, name: str, default: Any = None) -> Any:
        self._known.append(name)
        return self._data.get(name, default)

    def table(self, name: str) -> Table:
        return Table(self.raw(name, {}), self.key(name), self._source)

    def int(self, name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
        value = self.raw(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(name, f"expected an integer, got {_describe(value)}")
        self._bounds(name, value, minimum, maximum)
        return value

    def float(self, name: str, default: float, *, minimum: float | None = None, positive: bool = False) -> float:
        value = self.raw(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(name, f"expected a number, got {_describe(value)}")
        if positive and value <= 0:
            raise self.error(name, f"must be > 0, got {value!r}")
        self._bounds(name, value, minimum, None)
        return float(value)

    def str(self, name: str, default: str | None, *, nonempty: bool = True) -> str | None:
        value = self.raw(name, default)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.error(name, f"expected a string, got {_describe(value)}")
        if nonempty and not value.strip():
            raise self.error(name, "must not be empty")
        return value

    def enum(self, name: str, enum: type[E], default: E) -> E:
        value = self.raw(name, default.value)
        choices = [m.value for m in enum]
        if not isinstance(value, str) or value not in choices:
            raise self.error(name, f"expected one of {', '.join(choices)}; got {_describe(value)}")
        return enum(value)

    def str_list(self, name: str, default: list[str] | None) -> tuple[str, ...] | None:
        value = self.raw(name, default)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(name, f"expected an array of strings, got {_describe(value)}")
        return tuple(value)

    def mapping(self, name: str) -> dict[str, Any]:
        value = self.raw(name, {})
        if not isinstance(value, Mapping):
            raise self.error(name, f"expected a table, got {_describe(value)}")
        return dict(value)

    def _bounds(self, name: str, value: float, minimum: float | None, maximum: float | None) -> None:
        if minimum is not None and value < minimum:
            raise self.error(name, f"must be >= {minimum}, got {value!r}")
        if maximum is not None and value > maximum:
            raise self.error(name, f"must be <= {maximum}, got {value!r}")

    def finish(self) -> None:
        """Reject every key that no reader asked for."""
        for name in self._data:
            if name not in self._known:
                close = difflib.get_close_matches(name, self._known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(set(self._known)))}"
                raise self.error(name, f"unknown key{hint}")
