"""What the request path forwards: one validated request (the front door's validators make it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Job"]


@dataclass(slots=True)
class Job:
    """A validated request, ready to queue and forward."""

    path: str  # worker path
    body: dict[str, Any]  # parsed body; the relay names each attempt in it where the engine aborts by name
    stream: bool
    model: str | None  # as given (None: not given, or /generate)
    affinity: str | None  # leading text of the prompt, for prefix-aware choice
    single: bool  # one prompt (so a scalar rid can be set)
    size: int = 0  # body bytes, for the token estimate of fair admission
    # completion tokens asked for per choice: max_completion_tokens over max_tokens, as the engines
    # read them (None: not given)
    max_tokens: int | None = None
    choices: int = 1  # ``n``
    upstream_name: str | None = None  # the name its last attempt went to its worker under (None: unnamed)
    request_id: str | None = None  # the proxy's id for it, told the client (None: one is made when it is named)
    on_worker: bool = False  # an attempt of it is on a worker now (the relay's; False while it waits in the queue)
