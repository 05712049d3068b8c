"""API keys: who may call the proxy, and which priority class a key's requests get.

Keys come from the policy's ``[auth]`` section: ``api_keys_env`` names an environment variable
(entries separated by commas or newlines), ``api_keys_file`` a file with one entry per line; an
entry is ``KEY``, ``KEY batch`` or ``KEY:batch`` (likewise ``interactive``: the key's class; a ``batch`` key
cannot raise itself to ``interactive`` with the priority header), optionally followed by
``name=NAME``: the name the key is known by in the policy's ``[keys.NAME]`` (its weight and
limits), in ``/metrics`` and in logs; the secret itself is never shown. A key without a name is
``key-N`` (N: its place among all entries, from 1). Blank lines and ``#`` comments are ignored.
The admin key (``admin_key_env`` / ``admin_key_file``) guards ``/admin/*``. With no key configured
the corresponding endpoints are open (every caller is ``anonymous``), and :func:`describe` says so.

Keys are found in constant time: the ring is indexed by the SHA-256 digest of each key, and a
presented token is looked up by its digest, so the time taken does not depend on how much of a
real key the token matches (the admin key likewise, with :func:`hmac.compare_digest`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from proxy.errors import ApiError
from proxy.policy import AuthSettings
from proxy.request.admission import Priority


class AuthConfigError(ValueError):
    """A key file is missing or malformed, or a key names an unknown class."""


ANONYMOUS = "anonymous"  # the caller of an open proxy


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a key stands for: its configured name and class (None: the policy's default)."""

    name: str
    cls: Priority | None = None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True, slots=True)
class KeyRing:
    keys: Mapping[str, Caller] = field(default_factory=dict)  # key -> who it stands for
    admin_keys: frozenset[str] = frozenset()
    by_digest: Mapping[bytes, Caller] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.keys and not self.by_digest:
            object.__setattr__(self, "by_digest", {_digest(k): c for k, c in self.keys.items()})

    @property
    def open(self) -> bool:
        return not self.keys

    def names(self) -> list[str]:
        """The configured names, each once (the bounded set of ``/metrics`` key labels)."""
        return sorted({c.name for c in self.keys.values()})

    @property
    def admin_open(self) -> bool:
        return not self.admin_keys


def parse_entries(text: str, source: str, first: int = 1) -> dict[str, Caller]:
    """The entries of one source; unnamed keys are ``key-N`` counting from ``first``."""
    out: dict[str, Caller] = {}
    for n, line in enumerate(text.replace(",", "\n").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        name = f"key-{first + len(out)}"
        named = [p for p in parts[1:] if p.startswith("name=")]
        if named:
            name = named[-1].removeprefix("name=")
            parts = [p for p in parts if p not in named]
            if not name:
                raise AuthConfigError(f"{source}: entry {n} has an empty name=")
        if len(parts) == 1 and ":" in parts[0]:  # KEY:CLASS (the name, if any, is set apart above)
            key, _, cls_name = parts[0].rpartition(":")
            if cls_name.lower() in (p.value for p in Priority):
                parts = [key, cls_name]
        if len(parts) > 2:
            raise AuthConfigError(f"{source}: entry {n} has {len(parts)} fields; expected 'KEY' or 'KEY CLASS'")
        cls: Priority | None = None
        if len(parts) == 2:
            try:
                cls = Priority(parts[1].lower())
            except ValueError:
                raise AuthConfigError(
                    f"{source}: entry {n} names class {parts[1]!r}; expected interactive or batch"
                ) from None
        out[parts[0]] = Caller(name, cls)
    return out


def _read_file(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise AuthConfigError(f"cannot read key file {path}: {exc.strerror or exc}") from None


def load_keyring(
    auth: AuthSettings, environ: Mapping[str, str] | None = None, *, refuse_unkeyed: bool = True
) -> KeyRing:
    """Build the key ring from the policy's ``auth`` section (each source may be unset). A source the
    policy names that gives no key (a variable unset or empty, an empty file) is refused
    (:func:`unkeyed`): the proxy would run open where its operator asked for keys, a mistyped ``-e``
    away from exposing every route and the admin API on a public address."""
    env = os.environ if environ is None else environ
    keys: dict[str, Caller] = {}
    admin: set[str] = set()
    if auth.api_keys_env:
        keys.update(parse_entries(env.get(auth.api_keys_env, ""), f"${auth.api_keys_env}"))
    if auth.api_keys_file is not None:
        path = str(auth.api_keys_file)
        keys.update(parse_entries(_read_file(path), path, first=len(keys) + 1))
    if auth.admin_key_env:
        admin.update(parse_entries(env.get(auth.admin_key_env, ""), f"${auth.admin_key_env}"))
    if auth.admin_key_file is not None:
        admin.update(parse_entries(_read_file(str(auth.admin_key_file)), str(auth.admin_key_file)))
    ring = KeyRing(keys=keys, admin_keys=frozenset(admin))
    if refuse_unkeyed and (problem := unkeyed(auth, ring)):
        raise AuthConfigError(problem)
    return ring


def unkeyed(auth: AuthSettings, ring: KeyRing) -> str | None:
    """What is wrong when the policy names where keys come from and they gave none (None: nothing)."""

    def sources(env: str | None, file: object) -> str:
        return " and ".join(([f"${env}"] if env else []) + ([str(file)] if file is not None else []))

    problems = []
    if ring.open and (named := sources(auth.api_keys_env, auth.api_keys_file)):
        problems.append(f"the policy takes API keys from {named}, which gave none")
    if ring.admin_open and (named := sources(auth.admin_key_env, auth.admin_key_file)):
        problems.append(f"the policy takes the admin key from {named}, which gave none")
    if not problems:
        return None
    return "; ".join(problems) + " (set them, or remove the setting from [auth] to run open on purpose)"


def bearer(headers: Mapping[str, str]) -> str | None:
    value = headers.get("Authorization")
    if value:
        scheme, _, token = value.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return None
    return headers.get("x-api-key") or None


def _match(token: str, candidates: Iterable[str]) -> str | None:
    found = None
    for key in candidates:  # every candidate is compared: no early exit
        if hmac.compare_digest(token.encode(), key.encode()):
            found = key
    return found


def check_api_key(ring: KeyRing, headers: Mapping[str, str]) -> Caller:
    """Who the caller is (``anonymous`` on an open proxy); raises 401 when a key is required."""
    if ring.open:
        return Caller(ANONYMOUS)
    token = bearer(headers)
    if token is None:
        raise ApiError(
            401,
            "missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
            type="authentication_error",
            code="invalid_api_key",
        )
    caller = ring.by_digest.get(_digest(token))
    if caller is None:
        raise ApiError(401, "incorrect API key provided", type="authentication_error", code="invalid_api_key")
    return caller


def check_admin_key(ring: KeyRing, headers: Mapping[str, str]) -> None:
    if ring.admin_open:
        return
    token = bearer(headers)
    if token is None or _match(token, ring.admin_keys) is None:
        raise ApiError(
            401,
            "admin endpoints need the admin key ('Authorization: Bearer <admin key>')",
            type="authentication_error",
            code="invalid_api_key",
        )


def describe(ring: KeyRing) -> list[str]:
    """Start-up lines about who may call the proxy."""
    lines = []
    if ring.open:
        lines.append("no API key configured: the proxy runs OPEN (anyone who reaches the port may call it)")
    else:
        lines.append(f"API keys: {len(ring.keys)} configured")
    if ring.admin_open:
        lines.append("no admin key configured: /admin endpoints are OPEN")
    return lines
