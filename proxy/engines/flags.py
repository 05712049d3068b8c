"""Engine command-line flags, engine-neutral: the spec of one flag, checking a policy value against
it, writing values out, and reading a command line back into ``{field_name: value}``.

Both SGLang and vLLM derive a flag from a config field as ``"--" + name.replace("_", "-")``; each
engine package keeps its own table of :class:`FlagSpec` (``proxy.engines.<engine>.argv``) and its
own rules for booleans and the flags the supervisor adds.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class FlagSpec:
    """What an engine's parser accepts for one flag.

    ``type`` is one of ``"bool"``, ``"int"``, ``"float"``, ``"str"``, ``"int_list"`` (``nargs="+"``
    of ints). ``minimum``/``maximum`` are sanity bounds the proxy adds (engines check some of these
    only after start-up, which costs minutes on a GPU host).
    """

    type: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None


def spec(type_: str, *choices: str, minimum: float | None = None, maximum: float | None = None) -> FlagSpec:
    """Shorthand for flag tables: ``spec("str", "fcfs", "lpm")``, ``spec("int", minimum=1)``."""
    return FlagSpec(type=type_, choices=choices or None, minimum=minimum, maximum=maximum)


def flag_name(name: str) -> str:
    """``max_running_requests`` -> ``--max-running-requests``."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True, slots=True)
class FlagTable:
    """One engine's flags: those a policy may set, those the supervisor sets, those removed."""

    engine: str  # the engine's name in messages: "SGLang", "vLLM"
    known: Mapping[str, FlagSpec]
    supervisor: Mapping[str, FlagSpec]
    removed: Mapping[str, str]  # name -> what to write instead
    secret: frozenset[str] = frozenset()  # names whose value is a secret (an API key): masked in logs
    identity: frozenset[str] = frozenset()  # names that say which model a worker serves: no trial changes them

    def lookup(self, name: str) -> FlagSpec | None:
        return self.known.get(name) or self.supervisor.get(name)

    def check_extra_args(self, extra_args: Sequence[str]) -> str | None:
        """Why verbatim ``extra_args`` cannot be used (they set a flag the supervisor sets), or ``None``."""
        for name in self.supervisor:
            flag = flag_name(name)
            if any(a == flag or a.startswith(flag + "=") for a in extra_args):
                return f"{flag} is set by the supervisor (use engine.host / engine.base_port)"
        return None

    def masked(self, argv: Sequence[str]) -> list[str]:
        """``argv`` with the values of secret flags replaced by ``***`` (for logs)."""
        flags = {flag_name(name) for name in self.secret}
        shown = list(argv)
        for i, token in enumerate(shown):
            if token in flags and i + 1 < len(shown):
                shown[i + 1] = "***"
            elif token.split("=", 1)[0] in flags and "=" in token:
                shown[i] = token.split("=", 1)[0] + "=***"
        return shown

    def check(self, name: str, value: object) -> str | None:
        """Why ``name = value`` is not a valid engine arg for a policy, or ``None`` if it is."""
        if name in self.removed:
            return f"{flag_name(name)} is {self.removed[name]}"
        if name in self.supervisor:
            return "set by the supervisor (use engine.host / engine.base_port)"
        flag = self.known.get(name)
        if flag is None:
            close = difflib.get_close_matches(name, [*self.known, *self.removed], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            return f"unknown {self.engine} flag {flag_name(name)}{hint} (others can go in engine.extra_args)"
        return check_value(flag, value)


def check_value(flag: FlagSpec, value: object) -> str | None:
    """Why ``value`` does not fit ``flag``, or ``None``."""
    if flag.type == "bool":
        return None if isinstance(value, bool) else f"expected true or false, got {value!r}"
    if flag.type == "int_list":
        if not isinstance(value, list) or not value:
            return f"expected a non-empty list of integers, got {value!r}"
        for item in value:
            problem = _check_number(flag, item, integer=True)
            if problem:
                return problem
        return None
    if flag.type in ("int", "float"):
        return _check_number(flag, value, integer=flag.type == "int")
    if not isinstance(value, str):
        return f"expected a string, got {value!r}"
    if flag.choices is not None and value not in flag.choices:
        return f"expected one of {', '.join(flag.choices)}; got {value!r}"
    if not value:
        return "expected a non-empty string"
    return None


def _check_number(flag: FlagSpec, value: object, *, integer: bool) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        return f"expected {'an integer' if integer else 'a number'}, got {value!r}"
    if flag.minimum is not None and value < flag.minimum:
        return f"must be >= {flag.minimum:g}, got {value!r}"
    if flag.maximum is not None and value > flag.maximum:
        return f"must be <= {flag.maximum:g}, got {value!r}"
    return None


def format_value(value: object) -> str:
    """A value as a command-line token (floats keep their exact repr)."""
    return repr(value) if isinstance(value, float) else str(value)


_NUMBER = re.compile(r"-?\d+(\.\d*)?([eE][-+]?\d+)?")


def _guess(token: str) -> object:
    if _NUMBER.fullmatch(token):
        return int(token) if token.lstrip("-").isdigit() else float(token)
    return token


def _convert(flag: FlagSpec | None, values: list[str]) -> object:
    if flag is None:
        if not values:
            return True
        return _guess(values[0]) if len(values) == 1 else [_guess(v) for v in values]
    if flag.type == "bool":
        return True
    try:
        if flag.type == "int_list":
            return [int(v) for v in values]
        if len(values) != 1:
            return values
        if flag.type == "int":
            return int(values[0])
        if flag.type == "float":
            return float(values[0])
    except ValueError:
        return values[0] if len(values) == 1 else values
    return values[0]


def parse_flags(argv: Sequence[str], lookup: Callable[[str], FlagSpec | None]) -> dict[str, object]:
    """``["--tp-size", "2", "--trust-remote-code"]`` -> ``{"tp_size": 2, "trust_remote_code": True}``.

    Tokens before the first ``--flag`` (a launcher such as ``python3 -m sglang.launch_server``) are
    skipped. Values are typed by ``lookup(name)``; unknown flags get ints/floats where they look
    like numbers, ``True`` when bare, and a list when followed by several values. ``--flag=value``
    is understood too. A flag given twice keeps the last value, as argparse does.
    """
    out: dict[str, object] = {}
    name: str | None = None
    values: list[str] = []

    def flush() -> None:
        if name is not None:
            out[name] = _convert(lookup(name), values)

    for token in argv:
        if token.startswith("--") and len(token) > 2:
            flush()
            flag, eq, inline = token[2:].partition("=")
            name, values = flag.replace("-", "_"), ([inline] if eq else [])
        elif name is not None:
            values.append(token)
    flush()
    return out
