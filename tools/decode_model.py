"""The calibrated model of the tensor-core decode kernel: the static walk's counts turned into a predicted time by two
constants fitted to one GPU run's measurements (tools/bound_decode.py prints it beside every measurement).

Per KV-head token, in issue slots of an SM (its schedulers x the bound's clock):

    slots = a x warp-instructions + SLOTS_PER_WAVEFRONT x shared wavefronts + c x (1, or lines)

and the kernel takes the longer of those slots and the memory time of its bytes. SLOTS_PER_WAVEFRONT is not fitted: an
SM's shared memory serves one wavefront a clock, the time of one issue slot on each of its 4 schedulers. a (the share of
an instruction's slot the other warps cannot fill) and c are fitted by least squares on the relative error, over the
run's variants that are not at the memory roofline. Two readings of c, fitted alike: paid per token ("token": each
stage's barriers and the dependent chain of ldmatrix, mma, exp and mma that no warp of the block can overlap), or per
128-byte line the token's codes touch ("line": the L2's tag lookups, one a line a request, where a KV head's piece of a
row shares its lines with the other heads'). Every run fitted so far kept rows whole, where both readings fit; a run
with each KV head's rows together (fewer lines a token) tells them apart. Leave-one-out errors (each variant predicted
from a fit without it) say how well the model predicts a variant it has not seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SLOTS_PER_WAVEFRONT = 4.0  # one shared-memory wavefront a clock per SM = one slot of each of its 4 schedulers
MEMORY_BOUND = 0.8  # a measured fraction of copy bandwidth above this says nothing about the issue side: not fitted
READINGS = ("token", "line")  # what the constant c is paid for


@dataclass(frozen=True)
class Point:
    """One measured variant: the walk's counts per KV-head token and the slots per token the GPU took."""

    name: str
    instructions: float
    wavefronts: float
    slots: float
    lines: float = 0.0  # 128-byte lines a token's codes touch (the "line" reading's count)


@dataclass(frozen=True)
class Model:
    per_instruction: float  # a
    constant: float  # c
    reading: str = "token"  # what c is paid for: a token, or a line its codes touch

    def slots(self, instructions: float, wavefronts: float, lines: float = 0.0) -> float:
        paid = 1.0 if self.reading == "token" else lines
        return self.per_instruction * instructions + SLOTS_PER_WAVEFRONT * wavefronts + self.constant * paid


def measured_slots(latency_s: float, kv_head_tokens: int, slots_per_s: float) -> float:
    """Issue slots per KV-head token that a measured launch took (slots_per_s: SMs x schedulers x clock)."""
    return latency_s * slots_per_s / kv_head_tokens


def fit(points: list[Point], reading: str = "token") -> Model:
    """a and c, c paid as `reading` says, that minimise the squared relative error of the predicted slots over points
    (at least two)."""
    if len(points) < 2:
        raise ValueError(f"fitting two constants needs two measured variants; got {len(points)}")
    slots = np.array([p.slots for p in points])
    paid = np.ones(len(points)) if reading == "token" else np.array([p.lines for p in points])
    columns = np.c_[[p.instructions for p in points], paid]
    target = 1.0 - SLOTS_PER_WAVEFRONT * np.array([p.wavefronts for p in points]) / slots
    constants, *_ = np.linalg.lstsq(columns / slots[:, None], target, rcond=None)
    return Model(float(constants[0]), float(constants[1]), reading)


def relative_error(model: Model, point: Point) -> float:
    return model.slots(point.instructions, point.wavefronts, point.lines) / point.slots - 1.0


def leave_one_out(points: list[Point], reading: str = "token") -> dict[str, float]:
    """Each point's relative error under the model fitted to the others (needs three points or more)."""
    return {p.name: relative_error(fit(points[:i] + points[i + 1:], reading), p) for i, p in enumerate(points)}


def predicted_seconds(model: Model, instructions: float, wavefronts: float, bytes_read: float, copy_bytes_per_s: float,
                      kv_head_tokens: int, slots_per_s: float, lines: float = 0.0) -> float:
    """The longer of the compute time the model gives and the memory time of the bytes at copy bandwidth."""
    compute = model.slots(instructions, wavefronts, lines) * kv_head_tokens / slots_per_s
    return max(compute, bytes_read / copy_bytes_per_s)
