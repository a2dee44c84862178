"""Measured activations and transients, extrapolated: what `zerokit plan --calibrate` feeds the plan.

[Note: extrapolating a calibration]
Calibration (zerokit/profiling/calibrate.py) runs one forward and backward of the real model at eight
small shapes, batch b in {1, 2, 4, 8} x sequence s in {s1, s2}, and measures at each: the bytes autograd
saves in one block and outside the blocks (embeddings, head, loss), and the allocator's peak in four
phases of the step (forward; the loss and head's backward; the blocks' backward; after them, where the
embedding's and other parameter-sized gradients are made). Each is fitted, by least squares, as

    bytes(b, s) = c0 + c1·b·s + c2·b·s² + c3·s²

parameter-sized temporaries (c0), per-token terms (c1), attention matrices that an eager or math
kernel materialises (c2), and tensors the batch shares (a causal mask: c3). The peak of a step is the
largest phase peak: at a small shape the embedding's gradient temporaries (c0) dominate, at a large
one the logits' gradients (c1); both are measured, so neither has to be guessed. The saved bytes of one block are linear
in tokens because every op saves a fixed number of per-token tensors; what the formulas in memory.py price from first
principles (Korthikanti et al. 2022) the calibration reads from the model's own code, fp32 upcasts,
unfused activations and the attention kernel the CPU really picks included. A block count from the
model spec scales the per-block term, so a 2-block copy calibrates a 40-block model. Pure numbers
here: no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from zerokit._support.jsonfile import load_record, write_json

BASIS = ("1", "b*s", "b*s^2", "s^2")
PHASES = ("forward", "head", "blocks", "tail")
RELATIVE_PHASES = PHASES[:3]
"""Phases whose peak holds every saved activation: fitted as the excess over them, so that they scale
with the number of blocks; the tail's peak (after the last block's backward) is fitted whole."""


def _basis(batch: int, seq: int) -> tuple[float, ...]:
    return (1.0, batch * seq, batch * seq * seq, seq * seq)


def solve(rows: list[list[float]], values: list[float]) -> list[float]:
    """Least squares by the normal equations, Gaussian elimination with partial pivoting (4 unknowns)."""
    n = len(rows[0])
    normal = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * v for r, v in zip(rows, values))]
              for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda k: abs(normal[k][col]))
        normal[col], normal[pivot] = normal[pivot], normal[col]
        if normal[col][col] == 0:
            raise ValueError("calibration shapes do not determine the fit; use two different sequence lengths")
        for row in range(n):
            if row != col:
                factor = normal[row][col] / normal[col][col]
                normal[row] = [a - factor * b for a, b in zip(normal[row], normal[col])]
    return [normal[i][n] / normal[i][i] for i in range(n)]


SIMPLE = (0, 1)  # a constant and a per-token term: tried first, as extrapolating s^2 terms is risky
TOLERANCE = 0.03


def _least_squares(samples: list[tuple[int, int, float]], terms: tuple[int, ...]) -> tuple[float, ...]:
    """Coefficients of BASIS (zero outside `terms`), scaled so that elimination works on numbers near 1."""
    scale = {i: max(abs(_basis(b, s)[i]) for b, s, _ in samples) or 1.0 for i in terms}
    rows = [[_basis(b, s)[i] / scale[i] for i in terms] for b, s, _ in samples]
    solved = dict(zip(terms, solve(rows, [v for *_, v in samples])))
    return tuple(solved[i] / scale[i] if i in solved else 0.0 for i in range(len(BASIS)))


def _residual(coefficients: tuple[float, ...], samples: list[tuple[int, int, float]]) -> float:
    """The worst relative miss of a fit over the samples."""
    return max(abs(sum(c * x for c, x in zip(coefficients, _basis(b, s))) - v) / max(abs(v), 1.0)
               for b, s, v in samples)


def _fit(samples: list[tuple[int, int, float]]) -> tuple[float, ...]:
    """The simple basis if it reproduces every sample within TOLERANCE, else the full one."""
    simple = _least_squares(samples, SIMPLE)
    worst = _residual(simple, samples)
    enough = len(samples) >= len(BASIS) and len({x[0] for x in samples}) > 1 and len({x[1] for x in samples}) > 1
    return simple if worst <= TOLERANCE or not enough else _least_squares(samples, tuple(range(len(BASIS))))


@dataclass(frozen=True)
class Fit:
    """bytes(b, s) = max(floor, sum of coefficients x BASIS); see [Note: extrapolating a calibration]."""

    coefficients: tuple[float, ...]
    floor: float | None = None
    """A peak that two regimes take turns to set (a parameter-sized gradient at small shapes, the logits'
    gradients at large ones) is their maximum: the smallest sample is the first, the fit the second."""

    @staticmethod
    def of(samples: list[tuple[int, int, float]]) -> Fit:
        """From (batch, seq, bytes) samples. The fit starts from the two largest token counts and takes in
        smaller ones while it still reproduces them within TOLERANCE; what it could not take sets the floor."""
        counts = sorted({b * s for b, s, _ in samples}, reverse=True)
        chosen = [x for x in samples if x[0] * x[1] >= counts[min(1, len(counts) - 1)]]
        for count in counts[2:]:
            trial = [x for x in samples if x[0] * x[1] >= count]
            if _residual(_fit(trial), trial) > TOLERANCE:
                break
            chosen = trial
        rest = [x for x in samples if x not in chosen]
        fitted = Fit(_fit(chosen))
        if not rest:
            return fitted
        if all(v > fitted(b, s) + TOLERANCE * abs(v) for b, s, v in rest):  # a second regime above the fit
            # floors the peak (a parameter-sized gradient at small shapes)
            return Fit(fitted.coefficients, max(v for *_, v in rest))
        return Fit(_fit(samples))

    def __call__(self, batch: int, seq: int) -> int:
        value = sum(c * x for c, x in zip(self.coefficients, _basis(batch, seq)))
        return round(value if self.floor is None else max(self.floor, value))


@dataclass(frozen=True)
class Calibration:
    """One model measured at small shapes on one device, in one compute dtype."""

    model: str
    precision: str
    device: str
    n_layers: int
    """Blocks in the model that was run (the per-block fit is per block)."""
    block: Fit
    outside: Fit
    forward: Fit
    head: Fit
    blocks: Fit
    tail: Fit
    samples: tuple[dict, ...] = ()
    """What was measured at each shape (bytes), for the memo and for checking the fit."""
    resident_bytes: int = 0
    """Resident memory of a process that imported torch and zerokit and joined a process group, before
    building a model: the framework's own share of a rank (0: not measured)."""
    allocator_slack: float = 0.0
    """Resident growth per byte of the step's allocated growth - 1 (glibc or CUDA caching)."""
    resident_fixed_bytes: int = 0
    """Resident growth beyond the model states that does not follow the step's allocations (See [Note:
    measuring allocator slack] in zerokit/profiling/resident.py)."""
    copy_seconds: tuple[dict, ...] = ()
    """Per copy of the model trained at the target's stage, world size and shape: {"blocks", "seconds",
    "cpu_seconds"}, each phase's seconds per step, and in "seconds" the target's own collectives replayed on the
    copy's ranks ("run_communication") (See [Note: timing copies] in zerokit/profiling/resident.py)."""
    seconds_per_flop: dict = field(default_factory=dict)
    """Measured forward and backward seconds per FLOP of the model on this device (by phase)."""
    notes: tuple[str, ...] = ()

    def activations(self, batch: int, seq: int, layers: int | None = None) -> int:
        """Saved bytes of a forward (and the loss) at (batch, seq) with `layers` blocks."""
        layers = self.n_layers if layers is None else layers
        return layers * self.block(batch, seq) + self.outside(batch, seq)

    def phase_peaks(self, batch: int, seq: int, layers: int | None = None) -> dict[str, int]:
        """Allocated growth over a forward and backward at each phase's peak (gradients preallocated)."""
        saved = self.activations(batch, seq, layers)
        return {phase: getattr(self, phase)(batch, seq) + (saved if phase in RELATIVE_PHASES else 0)
                for phase in PHASES}

    def as_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(raw: dict) -> Calibration:
        fits = {k: Fit(tuple(raw[k]["coefficients"]), raw[k].get("floor")) for k in ("block", "outside", *PHASES)}
        rest = {k: v for k, v in raw.items() if k not in fits}
        rest["samples"] = tuple(rest.get("samples", ()))
        rest["notes"] = tuple(rest.get("notes", ()))
        rest["copy_seconds"] = tuple(rest.get("copy_seconds", ()))
        return Calibration(**rest, **fits)

    def save(self, path: str | Path) -> None:
        write_json(path, self.as_dict())

    @staticmethod
    def load(path: str | Path) -> Calibration:
        return load_record(path, "calibration file", "make one with zerokit plan --calibrate", Calibration.from_dict)
