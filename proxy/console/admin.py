"""A small client of the proxy's admin API, shared by ``pacer status`` and ``pacer decisions``.

The URL comes from ``--url`` (else ``$PACER_URL``, else http://127.0.0.1:8000); the admin key from
``--admin-key`` (else ``$PACER_ADMIN_KEY``), sent as ``Authorization: Bearer``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import orjson

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "PACER_URL"
KEY_ENV = "PACER_ADMIN_KEY"


class AdminError(Exception):
    """The proxy could not be reached or refused the call; the message says which, in words."""


def base_url(text: str) -> str:
    """The proxy's base URL: ``http(s)://host[:port]``, an OpenAI base URL's ``/v1`` taken off (the
    admin API is beside it); anything else raises ValueError naming what is wrong."""
    url = text.strip().rstrip("/")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"expected the proxy's URL, such as {DEFAULT_URL}, got {text!r}")
    return url.removesuffix("/v1")


def _url_arg(text: str) -> str:
    try:
        return base_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def count(text: str) -> int:
    """A count for the command line: a whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value}")
    return value


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", type=_url_arg, default=None, help=f"the proxy's base URL (default: ${URL_ENV} or {DEFAULT_URL})"
    )
    parser.add_argument("--admin-key", default=None, help=f"the proxy's admin key (default: ${KEY_ENV})")


class AdminClient:
    def __init__(self, url: str | None, admin_key: str | None, *, timeout_s: float = 10.0) -> None:
        try:
            self.url = base_url(url or os.environ.get(URL_ENV) or DEFAULT_URL)
        except ValueError as exc:
            raise AdminError(f"{exc} (from ${URL_ENV})") from None
        self.key = admin_key if admin_key is not None else os.environ.get(KEY_ENV)
        self.timeout_s = timeout_s

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AdminClient:
        """The client the command line (or the environment) names; a bad ``$PACER_URL`` ends the
        command with its message (exit 1)."""
        try:
            return cls(args.url, args.admin_key)
        except AdminError as exc:
            raise SystemExit(f"pacer: {exc}") from None

    def get(self, path: str) -> Any:
        return self._call(urllib.request.Request(self.url + path))

    def post(self, path: str, body: Any) -> Any:
        """POST ``body`` as JSON; the answer's JSON (a refusal raises :class:`AdminError` with its message)."""
        data = orjson.dumps(body)
        return self._call(
            urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        )

    def _call(self, request: urllib.request.Request) -> Any:
        path = request.full_url[len(self.url) :]
        if self.key:
            request.add_header("Authorization", f"Bearer {self.key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                return orjson.loads(resp.read())
        except urllib.error.HTTPError as exc:
            message = exc.reason
            with contextlib.suppress(ValueError, KeyError, TypeError):
                message = orjson.loads(exc.read())["error"]["message"]
            hint = f" (the admin key: --admin-key or ${KEY_ENV})" if exc.code in (401, 403) else ""
            raise AdminError(f"{self.url}{path} answered {exc.code}: {message}{hint}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise AdminError(f"cannot reach the proxy at {self.url}: {reason}") from None
        except ValueError:
            raise AdminError(f"{self.url}{path} did not answer JSON") from None
