"""A small client of the proxy's admin API, shared by ``pacer status`` and ``pacer decisions``.

The URL comes from ``--url`` (else ``$PACER_URL``, else http://127.0.0.1:8000); the admin key from
``--admin-key`` (else ``$PACER_ADMIN_KEY``), sent as ``Authorization: Bearer``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import urllib.error
import urllib.request
from typing import Any

import orjson

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "PACER_URL"
KEY_ENV = "PACER_ADMIN_KEY"


class AdminError(Exception):
    """The proxy could not be reached or refused the call; the message says which, in words."""


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help=f"the proxy's base URL (default: ${URL_ENV} or {DEFAULT_URL})")
    parser.add_argument("--admin-key", default=None, help=f"the proxy's admin key (default: ${KEY_ENV})")


class AdminClient:
    def __init__(self, url: str | None, admin_key: str | None, *, timeout_s: float = 10.0) -> None:
        self.url = (url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
        self.key = admin_key if admin_key is not None else os.environ.get(KEY_ENV)
        self.timeout_s = timeout_s

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AdminClient:
        return cls(args.url, args.admin_key)

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
            raise AdminError(f"{self.url}{path} answered {exc.code}: {message}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise AdminError(f"cannot reach the proxy at {self.url}: {reason}") from None
        except ValueError:
            raise AdminError(f"{self.url}{path} did not answer JSON") from None
