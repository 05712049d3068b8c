"""A bounded load for the real-engine tests, sent with the ``openai`` client.

``run_load`` sends ``n`` completions at once (each with a distinct prompt so no prefix cache
helps), ``max_tokens`` each with ``ignore_eos`` so every request costs the same, and reports what
came back: one result per request id, output tokens from ``usage``, and the wall time.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import openai

_LETTERS = "etaoinshrdlucmfwypvbgkjqxz"


def prompts(n: int, words: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    vocab = ["".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 7))) for _ in range(400)]
    return [f"request {i}: " + " ".join(rng.choice(vocab) for _ in range(words)) for i in range(n)]


@dataclass(slots=True)
class LoadResult:
    sent: int
    wall_s: float
    output_tokens: int = 0
    prompt_tokens: int = 0
    answered: dict[int, int] = field(default_factory=dict)  # request index -> responses seen
    errors: list[str] = field(default_factory=list)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def each_answered_once(self) -> bool:
        return (
            not self.errors and sorted(self.answered) == list(range(self.sent)) and set(self.answered.values()) == {1}
        )


async def run_load(
    base_url: str,
    model: str,
    *,
    n: int,
    words: int = 60,
    max_tokens: int = 256,
    timeout_s: float = 600.0,
    seed: int = 1,
) -> LoadResult:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=timeout_s, max_retries=0)
    result = LoadResult(sent=n, wall_s=0.0)

    async def one(i: int, prompt: str) -> None:
        try:
            resp = await client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
        except openai.OpenAIError as exc:
            result.errors.append(f"request {i}: {exc!r}")
            return
        result.answered[i] = result.answered.get(i, 0) + 1
        if resp.usage is not None:
            result.output_tokens += resp.usage.completion_tokens
            result.prompt_tokens += resp.usage.prompt_tokens

    start = time.monotonic()
    try:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts(n, words, seed))))
    finally:
        result.wall_s = time.monotonic() - start
        await client.close()
    return result
