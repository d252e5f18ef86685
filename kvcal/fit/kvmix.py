"""KVmix allocation: per-layer key/value bit widths and recent-pivotal-context (RPC) ratios from the
gradient-norm importance of W_k and W_v (KVmix, "KV Importance Analysis" and "Dynamic Pivotal
Context Selection"). Keys and values are ranked separately."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcal.errors import KvcalError

RPC_RATIO_HIGH = 0.2  # at 3 or 4 bits (paper)
RPC_RATIO_LOW = 0.1  # at 2 bits or fewer


@dataclass(frozen=True)
class WidthChoice:
    """The two widths one tensor kind (K or V) may take per layer."""

    high: int
    low: int

    def validate(self, label: str) -> None:
        for bits in (self.high, self.low):
            if not 1 <= bits <= 4:
                raise KvcalError(f"{label} bit width {bits} is outside 1-4")
        if self.high < self.low:
            raise KvcalError(f"{label} high width {self.high} is below its low width {self.low}")


def rpc_ratio(bits: int) -> float:
    return RPC_RATIO_HIGH if bits >= 3 else RPC_RATIO_LOW


def _by_importance(importance: torch.Tensor) -> list[int]:
    """Layer indices, most important first; ties keep layer order so allocation is deterministic."""
    return sorted(range(importance.numel()), key=lambda i: (-float(importance[i]), i))


def _assign(importance: torch.Tensor, widths: WidthChoice, num_high: int) -> list[int]:
    bits = [widths.low] * importance.numel()
    for layer in _by_importance(importance)[:num_high]:
        bits[layer] = widths.high
    return bits


def check_high_frac(high_frac: float) -> None:
    if not 0.0 <= high_frac <= 1.0:
        raise KvcalError(f"--high-frac {high_frac} is outside [0, 1]")


def allocate_top_fraction(importance: torch.Tensor, widths: WidthChoice, high_frac: float) -> list[int]:
    """The top `high_frac` of layers (rounded half up) get the high width, the rest the low one."""
    check_high_frac(high_frac)
    return _assign(importance, widths, math.floor(high_frac * importance.numel() + 0.5))


def check_target_bits(target_bits: float, widths: WidthChoice) -> None:
    if not widths.low <= target_bits <= widths.high:
        raise KvcalError(f"--target-bits {target_bits} is outside the widths' range [{widths.low}, {widths.high}]")


def allocate_to_target(importance: torch.Tensor, widths: WidthChoice, target_bits: float) -> list[int]:
    """As many of the most important layers get the high width as keep the mean at most `target_bits`."""
    check_target_bits(target_bits, widths)
    if widths.high == widths.low:
        return [widths.low] * importance.numel()
    num_high = math.floor((target_bits - widths.low) / (widths.high - widths.low) * importance.numel() + 1e-9)
    return _assign(importance, widths, num_high)


def allocate(importance: torch.Tensor, widths: WidthChoice, high_frac: float, target_bits: float | None,
             channels: list[int] | None = None) -> list[int]:
    """Per layer, its width by `target_bits` where given, else by `high_frac`. Layers whose tensor has no channel
    (`channels` 0: an MLA key on a layer without RoPE) store nothing and take the low width; the others are ranked
    among themselves, so that the fraction and the mean hold over the tensors stored."""
    stored = [layer for layer in range(importance.numel()) if channels is None or channels[layer]]
    chosen = (allocate_to_target(importance[stored], widths, target_bits) if target_bits is not None
              else allocate_top_fraction(importance[stored], widths, high_frac))
    bits = [widths.low] * importance.numel()
    for layer, width in zip(stored, chosen):
        bits[layer] = width
    return bits
