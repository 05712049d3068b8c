"""The model names the workers serve, as their ``/v1/models`` says (asked once, then cached).

Pools that declare their model (``[[pool]] model``) make the names known from the start
(:meth:`ModelCatalog.declared`), and each request goes to the pool serving its model.
An unknown ``model`` in a request is refused with 404 ``model_not_found`` before it queues; a
request without ``model`` gets the default (the first name served). Until some worker has
answered, names are unknown and nothing is refused for its model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

_log = logging.getLogger(__name__)


class ModelCatalog:
    def __init__(self) -> None:
        self.cards: list[dict[str, Any]] = []
        self.names: frozenset[str] = frozenset()
        self._pending: asyncio.Future[bool] | None = None
        self._last_try = -1e9

    @classmethod
    def declared(cls, models: Sequence[tuple[str, str]]) -> ModelCatalog:
        """The models the policy's pools declare, as (model, pool): known from the start, each card
        saying which pool serves it; the workers serve them under those names."""
        catalog = cls()
        catalog.cards = [{"id": m, "object": "model", "created": 0, "owned_by": "pacer", "pool": p} for m, p in models]
        catalog.names = frozenset(m for m, _ in models)
        return catalog

    @property
    def known(self) -> bool:
        return bool(self.names)

    @property
    def default(self) -> str | None:
        return self.cards[0]["id"] if self.cards else None

    def update(self, payload: Any) -> bool:
        data = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(data, list):
            return False
        cards = [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)]
        if not cards:
            return False
        before = self.names
        merged = {c["id"]: c for c in self.cards}
        merged.update((c["id"], c) for c in cards)
        self.cards = list(merged.values())
        self.names = frozenset(merged)
        if self.names != before:
            _log.info("serving model(s): %s", ", ".join(sorted(self.names)))
        return True

    async def refresh(self, session: aiohttp.ClientSession, url: str, timeout_s: float = 5.0) -> bool:
        """Ask one worker; True if it named at least one model."""
        try:
            async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    return False
                return self.update(await resp.json(content_type=None))
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            _log.debug("could not read %s/v1/models: %r", url, exc)
            return False

    async def ensure(self, session: aiohttp.ClientSession, urls: Sequence[str], retry_s: float = 5.0) -> None:
        """Learn the names before checking a request, once; concurrent callers share one lookup."""
        if self.names or not urls:
            return
        if self._pending is None:
            if time.monotonic() - self._last_try < retry_s:
                return
            self._last_try = time.monotonic()
            self._pending = asyncio.ensure_future(self._first(session, urls))
            self._pending.add_done_callback(lambda _: setattr(self, "_pending", None))
        await asyncio.shield(self._pending)

    async def _first(self, session: aiohttp.ClientSession, urls: Sequence[str]) -> bool:
        for url in urls:
            if await self.refresh(session, url):
                return True
        return False
