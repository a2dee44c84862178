"""Which compute dtype a DeepSpeed config asks for: the one reading of bf16/fp16 that the engine's config
and the translator share."""

from __future__ import annotations

from zerokit.config.dsconfig.reader import DeepSpeedConfig


def compute_dtype(config: DeepSpeedConfig) -> str:
    """'bf16', 'fp16' or 'fp32'. "auto" counts as off (See [Note: resolving "auto"] in auto.py)."""
    bf16_on, fp16_on = config.get("bf16.enabled") is True, config.get("fp16.enabled") is True
    if bf16_on and fp16_on:
        raise ValueError("bf16.enabled and fp16.enabled are both true; enable at most one")
    scaling_keys = sorted(name for name in config.under("fp16") if name != "enabled")
    # Loss-scaling keys with no `enabled` leave it unclear whether fp16 was meant. With an explicit
    # `enabled: false` (or "auto") they are inert, as in DeepSpeed, and the templates that carry them load.
    if scaling_keys and not config.given("fp16.enabled"):
        raise ValueError(f"fp16.{scaling_keys[0]} is set but fp16.enabled is not; set fp16.enabled to true or false")
    return "bf16" if bf16_on else "fp16" if fp16_on else "fp32"
