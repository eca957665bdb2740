"""Dynamic loss scaling for fp16: scale the loss up, skip steps whose gradients overflow.

On an overflow the step is skipped and, once `hysteresis` overflows have been seen since the last
growth, the scale is multiplied by `backoff` — at that overflow and at every further one, as
megatron-core's DynamicGradScaler does (the hysteresis budget is refilled only by growth, not by a
halving); after `growth_interval` clean steps in a row it is multiplied by `growth`.
Every rank must call `update` with the same found_inf (the optimizer agrees on it through the
global gradient norm), so the scale stays identical everywhere.
"""

from __future__ import annotations


class LossScaler:
    def __init__(
        self,
        initial_scale: float = 2.0**16,
        growth_interval: int = 1000,
        backoff: float = 0.5,
        growth: float = 2.0,
        hysteresis: int = 2,
        min_scale: float = 1.0,
    ):
        self.scale, self.growth_interval, self.backoff, self.growth = initial_scale, growth_interval, backoff, growth
        self.hysteresis, self.min_scale = hysteresis, min_scale
        self.clean_steps, self.overflows_left, self.skipped_steps = 0, hysteresis, 0

    def update(self, found_inf: bool) -> bool:
        """Record this step's outcome; returns True when the step must be skipped."""
        if found_inf:
            self.skipped_steps += 1
            self.clean_steps = 0
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
            return True
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= self.growth
            self.overflows_left = self.hysteresis
        return False

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("scale", "clean_steps", "overflows_left", "skipped_steps")}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
