"""SGLang's ``new_token_ratio``: how much of a running request's remaining ``max_new_tokens`` the
scheduler expects it still to use, when it decides whether a new request fits.

    init  = min(0.7 x schedule_conservativeness, 1)
    floor = min(init x 0.14, 1)
    decay = (init - floor) / 600                 per decode step that retracts nothing
    reset to init                                 when the scheduler goes idle
    after a retraction, set to min(1, (decoded + 20 x n) / (sum max_new_tokens + 1))
                                                  over the n requests that stay
"""

from __future__ import annotations

from dataclasses import dataclass

INIT_NEW_TOKEN_RATIO = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS
CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION


@dataclass(frozen=True, slots=True)
class RatioSchedule:
    init: float
    floor: float
    decay: float

    @classmethod
    def from_conservativeness(cls, conservativeness: float) -> RatioSchedule:
        init = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        floor = min(init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        return cls(init=init, floor=floor, decay=(init - floor) / NEW_TOKEN_RATIO_DECAY_STEPS)

    def decayed(self, current: float) -> float:
        return max(current - self.decay, self.floor)


def ratio_after_retract(total_decoded_tokens: int, num_reqs: int, total_max_new_tokens: int) -> float:
    """The ratio SGLang sets after a retraction, over the requests that remain running."""
    return min(1.0, (total_decoded_tokens + RETRACT_DECODE_STEPS * num_reqs) / (total_max_new_tokens + 1))
