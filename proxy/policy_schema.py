"""Policy keys declared once, and typed reading of one TOML table with errors that name the dotted key.

A settings dataclass declares each key once, as a field whose metadata is :func:`key`: its
default, what it means and its bounds
(``port: int = field(default=8000, metadata=key("listen port", minimum=0, maximum=65535))``).
:func:`read_settings` reads a table into such a dataclass from those declarations, and
:func:`defaults_toml` writes the documented defaults (``pacer check-policy --defaults``) from the
same declarations, so the reader, the defaults and their documentation cannot drift apart.

:class:`Table` wraps a mapping and hands out checked values (``table.int("port", 8000, minimum=0)``);
every key read is remembered, and :meth:`Table.finish` rejects the ones never read, suggesting the
closest known name. The policy module builds its dataclasses from these readers and nothing else
knows TOML.
"""

from __future__ import annotations

import builtins
import dataclasses
import difflib
import typing
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import tomli_w

from proxy.policy_retired import retired_message

E = TypeVar("E", bound=StrEnum)
T = TypeVar("T")
_METADATA_KEY = "policy"


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

    def mapping_names(self) -> list[builtins.str]:
        """The names this table holds (for tables of named sub-tables)."""
        return [str(k) for k in self._data]

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

    def enum(self, name: builtins.str, enum: type[E], default: E) -> E:
        value = self.raw(name, default.value)
        choices = [m.value for m in enum]
        if not isinstance(value, str) or value not in choices:
            raise self.error(name, f"expected one of {', '.join(choices)}; got {_describe(value)}")
        return enum(value)

    def str_list(self, name: builtins.str, default: list[builtins.str] | None) -> tuple[builtins.str, ...] | None:
        value = self.raw(name, default)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(name, f"expected an array of strings, got {_describe(value)}")
        return tuple(value)

    def mapping(self, name: builtins.str) -> dict[builtins.str, Any]:
        value = self.raw(name, {})
        if not isinstance(value, Mapping):
            raise self.error(name, f"expected a table, got {_describe(value)}")
        return dict(value)

    def _bounds(
        self, name: builtins.str, value: builtins.float, minimum: builtins.float | None, maximum: builtins.float | None
    ) -> None:
        if minimum is not None and value < minimum:
            raise self.error(name, f"must be >= {minimum}, got {value!r}")
        if maximum is not None and value > maximum:
            raise self.error(name, f"must be <= {maximum}, got {value!r}")

    def finish(self) -> None:
        """Reject every key that no reader asked for."""
        for name in self._data:
            if name not in self._known:
                retired = retired_message(self.key(name))
                if retired is not None:
                    raise self.error(name, retired)
                close = difflib.get_close_matches(name, self._known, n=1)
                hint = (
                    f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(set(self._known)))}"
                )
                raise self.error(name, f"unknown key{hint}")


# --------------------------------------------------------------------------------------------------
# declarations


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KeyDoc:
    """What a policy key means and which values it takes (in a settings field's metadata, see :func:`key`)."""

    doc: str
    minimum: float | None = None  # value >= minimum
    maximum: float | None = None  # value <= maximum
    positive: bool = False  # value > 0 (numbers)
    custom: bool = False  # read by its settings' own reader (arrays, pairs, paths, engine tables)


def key(
    doc: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    positive: bool = False,
    custom: bool = False,
) -> Mapping[str, KeyDoc]:
    """The metadata that declares a settings field: ``field(default=8000, metadata=key("listen port"))``."""
    return {_METADATA_KEY: KeyDoc(doc=doc, minimum=minimum, maximum=maximum, positive=positive, custom=custom)}


def key_doc(field: dataclasses.Field[Any]) -> KeyDoc:
    """The declaration of ``field``; every field of a settings dataclass has one."""
    key = field.metadata.get(_METADATA_KEY)
    if not isinstance(key, KeyDoc):
        raise TypeError(f"settings field {field.name} has no key() in its metadata")
    return key


def declared_keys(settings: type[Any]) -> list[tuple[dataclasses.Field[Any], KeyDoc]]:
    """The declared keys of a settings dataclass, in declaration order."""
    return [(f, key_doc(f)) for f in dataclasses.fields(settings)]


def read_settings(t: Table, settings: type[T], given: Mapping[str, Any] | None = None) -> T:
    """``settings`` built from table ``t``: the keys in ``given`` as given (read by the caller), every
    other declared key read and checked as its declaration says. Does not call :meth:`Table.finish`."""
    hints = typing.get_type_hints(settings)
    values = dict(given or {})
    for field, key in declared_keys(settings):
        if field.name in values:
            continue
        if key.custom:
            raise TypeError(f"{settings.__name__}.{field.name} needs its own reader")
        values[field.name] = _read_key(t, field.name, hints[field.name], field.default, key)
    return settings(**values)


def _read_key(t: Table, name: str, kind: Any, default: Any, key: KeyDoc) -> Any:
    if kind is bool:
        value = t.raw(name, default)
        if not isinstance(value, bool):
            raise t.error(name, f"expected true or false, got {value!r}")
        return value
    if kind is int:
        lo, hi = key.minimum, key.maximum
        return t.int(name, default, minimum=None if lo is None else int(lo), maximum=None if hi is None else int(hi))
    if kind is float:
        number = t.float(name, default, minimum=key.minimum, positive=key.positive)
        if key.maximum is not None and number > key.maximum:
            raise t.error(name, f"must be <= {key.maximum:g}, got {number!r}")
        return number
    if isinstance(kind, type) and issubclass(kind, StrEnum):
        return t.enum(name, kind, default)
    if kind is str:
        return t.str(name, default)
    if kind is Path:
        return Path(t.str(name, str(default)) or default)
    if kind == tuple[str, ...]:
        return t.str_list(name, list(default))
    raise TypeError(f"no reader for key {name} of type {kind!r}")


# --------------------------------------------------------------------------------------------------
# documented defaults


def _toml_value(value: Any) -> Any:
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_toml_value(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _toml_value(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a table of tables' entry
        fields = dataclasses.fields(value)
        return {f.name: _toml_value(getattr(value, f.name)) for f in fields if getattr(value, f.name) != _default(f)}
    return value


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _bounds_text(key: KeyDoc) -> str:
    parts = []
    if key.positive:
        parts.append("> 0")
    if key.minimum is not None:
        parts.append(f">= {key.minimum:g}")
    if key.maximum is not None:
        parts.append(f"<= {key.maximum:g}")
    return f" ({', '.join(parts)})" if parts else ""


def changed_keys(
    tables: Mapping[str, Any], *, secret: Callable[[str], bool], baseline: Mapping[str, Any] | None = None
) -> list[str]:
    """``table.key = value`` (TOML) for every declared key whose value is not its default, in
    declaration order; ``tables`` maps each table name to its settings object (``""``: keys with no
    table prefix). With a ``baseline`` settings object for a table, its keys are compared with that
    one's values instead of the defaults (a pool's overrides of the top-level tables). Values of
    keys whose dotted name ``secret`` accepts are masked."""
    lines = []
    for table, settings in tables.items():
        base = (baseline or {}).get(table)
        for field, _ in declared_keys(type(settings)):
            value = getattr(settings, field.name)
            if value == (_default(field) if base is None else getattr(base, field.name)):
                continue
            name = f"{table}.{field.name}" if table else field.name
            if isinstance(value, Mapping):
                value = {k: "***" if secret(f"{name}.{k}") else v for k, v in value.items()}
            shown = "***" if secret(name) else _inline(_toml_value(value))
            lines.append(f"{name} = {shown}")
    return lines


def _inline(value: Any) -> str:
    """One TOML value on one line (tomli-w writes arrays and tables over several)."""
    if isinstance(value, list):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    if isinstance(value, dict):
        pairs = ", ".join(f"{tomli_w.dumps({k: 0}).split(' = ')[0]} = {_inline(v)}" for k, v in value.items())
        return "{ " + pairs + " }" if pairs else "{}"
    return tomli_w.dumps({"v": value}).removeprefix("v = ").rstrip()


def defaults_toml(tables: Mapping[str, type[Any]]) -> str:
    """Every declared key of every table with its default, written by ``tomli_w``, under a comment
    that says what it means and which values it takes. Keys not set by default (``None``, empty
    tables) are shown commented out."""
    lines: list[str] = []
    for table, settings in tables.items():
        lines.append(f"[{table}]")
        for field, key in declared_keys(settings):
            lines.append(f"# {key.doc}{_bounds_text(key)}")
            value = _default(field)
            if value is None:
                lines.append(f"# {field.name} = (not set)")
            elif isinstance(value, Mapping) and not value:
                lines.append(f"# {field.name} = {{}}")
            else:
                lines.append(tomli_w.dumps({field.name: _toml_value(value)}).rstrip())
        lines.append("")
    return "\n".join(lines)
