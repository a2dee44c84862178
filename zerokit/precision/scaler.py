"""The loss scaler: DeepSpeed's dynamic loss scaling for fp16, and the one that does nothing for bf16 and fp32."""

from __future__ import annotations

from zerokit.config.typed import LossScaling


class DynamicLossScaler:
    """DeepSpeed's dynamic loss scaling: halve on overflow (after `hysteresis` overflows), never below
    `min_scale`; double at a clean step that follows a multiple of `window` clean steps since the last overflow
    (DeepSpeed 0.19.8's stable_interval, runtime/fp16/loss_scaler.py: the first doubling comes at the
    window + 1st clean step, then every `window`)."""

    def __init__(self, policy: LossScaling) -> None:
        self.policy = policy
        self.scale = policy.static_scale or float(2 ** policy.initial_scale_power)
        self._clean_steps = 0
        self._hysteresis_left = policy.hysteresis

    @property
    def is_dynamic(self) -> bool:
        return self.policy.static_scale is None

    def update(self, overflow: bool) -> None:
        if not self.is_dynamic:
            return
        if overflow:
            self._clean_steps = 0
            if self._hysteresis_left > 1:
                self._hysteresis_left -= 1
            else:
                self.scale = max(self.scale / 2, self.policy.min_scale)
        else:
            stable = self._clean_steps  # clean steps before this one, since the last overflow
            self._clean_steps += 1
            if stable > 0 and stable % self.policy.window == 0:
                self.scale *= 2
                self._hysteresis_left = self.policy.hysteresis

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])


class NoLossScaler:
    """bf16 and fp32: scale 1, nothing to update."""

    scale = 1.0
    is_dynamic = False

    def update(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": 1.0}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        if state.get("scale", 1.0) != 1.0:
            raise ValueError(f"the saved loss scale is {state['scale']}, but this run does not use fp16 loss scaling")


def make_loss_scaler(policy: LossScaling | None) -> DynamicLossScaler | NoLossScaler:
    return DynamicLossScaler(policy) if policy is not None else NoLossScaler()
