"""API keys: who may call the proxy, and which priority class a key's requests get.

Keys come from the policy's ``[auth]`` section: ``api_keys_env`` names an environment variable
(entries separated by commas or newlines), ``api_keys_file`` a file with one entry per line; an
entry is ``KEY``, ``KEY batch`` or ``KEY:batch`` (likewise ``interactive``: the key's class; a ``batch`` key
cannot raise itself to ``interactive`` with the priority header). Blank lines and ``#`` comments
are ignored. The admin key (``admin_key_env`` / ``admin_key_file``) guards ``/admin/*``.
With no key configured the corresponding endpoints are open, and :func:`describe` says so.
"""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class KeyRing:
    keys: Mapping[str, Priority | None] = field(default_factory=dict)  # key -> its class (None: default)
    admin_keys: frozenset[str] = frozenset()

    @property
    def open(self) -> bool:
        return not self.keys

    @property
    def admin_open(self) -> bool:
        return not self.admin_keys


def parse_entries(text: str, source: str) -> dict[str, Priority | None]:
    out: dict[str, Priority | None] = {}
    for n, line in enumerate(text.replace(",", "\n").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) == 1 and ":" in line:
            key, _, cls_name = line.rpartition(":")
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
        out[parts[0]] = cls
    return out


def _read_file(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise AuthConfigError(f"cannot read key file {path}: {exc.strerror or exc}") from None


def load_keyring(auth: AuthSettings, environ: Mapping[str, str] | None = None) -> KeyRing:
    """Build the key ring from the policy's ``auth`` section (each source may be unset)."""
    env = os.environ if environ is None else environ
    keys: dict[str, Priority | None] = {}
    admin: set[str] = set()
    if auth.api_keys_env:
        keys.update(parse_entries(env.get(auth.api_keys_env, ""), f"${auth.api_keys_env}"))
    if auth.api_keys_file is not None:
        keys.update(parse_entries(_read_file(str(auth.api_keys_file)), str(auth.api_keys_file)))
    if auth.admin_key_env:
        admin.update(parse_entries(env.get(auth.admin_key_env, ""), f"${auth.admin_key_env}"))
    if auth.admin_key_file is not None:
        admin.update(parse_entries(_read_file(str(auth.admin_key_file)), str(auth.admin_key_file)))
    return KeyRing(keys=keys, admin_keys=frozenset(admin))


def bearer(headers: Mapping[str, str]) -> str | None:
    value = headers.get("Authorization")
    if value:
        scheme, _, token = value.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return None
    return headers.get("x-api-key") or None


def _match(token: str, candidates: Iterable[str]) -> str | None:
    for key in candidates:
        if hmac.compare_digest(token.encode(), key.encode()):
            return key
    return None


def check_api_key(ring: KeyRing, headers: Mapping[str, str]) -> Priority | None:
    """The caller's key class (None: none or open); raises 401 when a key is required."""
    if ring.open:
        return None
    token = bearer(headers)
    if token is None:
        raise ApiError(
            401,
            "missing API key: send 'Authorization: Bearer <key>'",
            type="authentication_error",
            code="invalid_api_key",
        )
    cls = ring.keys.get(token, False)
    if cls is False:
        raise ApiError(401, "incorrect API key provided", type="authentication_error", code="invalid_api_key")
    return cls  # type: ignore[return-value]


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
