"""The tick schedule of SPEC.md as pure functions: no torch, no processes.

At tick ``t`` stage ``i`` of a pipeline of depth ``D``

- runs the forward of sample ``t - i``, and
- when learning, applies the gradient of sample ``t - 2(D - 1) + i`` (for the last stage that
  is the sample it has just run forward: it computes that sample's loss first),

each only when the sample exists (``0 <= s < N``). For ``D = 3`` and learning::

    tick | stage 0     | stage 1     | stage 2
    -----+-------------+-------------+------------
      0  | F0          |             |
      1  | F1          | F0          |
      2  | F2          | F1          | F0 B0
      3  | F3          | F2 B0       | F1 B1
      4  | F4 B0       | F3 B1       | F2 B2
      5  | F5 B1       | F4 B2       | F3 B3

A stream may be cut into segments by ``flush()``: each segment starts with an empty pipeline at
its own tick 0, so these functions take ticks and sample numbers relative to the segment.
"""

from __future__ import annotations

from collections.abc import Iterator


def forward_sample(stage: int, tick: int, num_samples: int | None = None) -> int | None:
    """The sample whose forward ``stage`` runs at ``tick``, or None.

    ``num_samples`` is the number of samples in the segment, or None while it is not yet known
    (the stream goes on): then every sample at or after 0 counts as existing.
    """
    s = tick - stage
    return s if _exists(s, num_samples) else None


def delay(stage: int, depth: int) -> int:
    """Steps between a sample's forward at ``stage`` and the step that applies its gradient."""
    return 2 * (depth - 1 - stage)


def backward_sample(stage: int, tick: int, depth: int, num_samples: int | None = None) -> int | None:
    """The sample whose gradient ``stage`` applies at ``tick`` when learning, or None."""
    s = tick - 2 * (depth - 1) + stage
    return s if _exists(s, num_samples) else None


def segment_ticks(num_samples: int, depth: int, learning: bool) -> int:
    """How many ticks a segment of ``num_samples`` samples lasts, drain included.

    Inference ends when the last output leaves the last stage (tick ``N - 1 + D - 1``);
    learning when stage 0 has applied the last gradient (tick ``N - 1 + 2(D - 1)``).
    """
    if num_samples <= 0:
        return 0
    return num_samples + (2 if learning else 1) * (depth - 1)


def last_tick(stage: int, num_samples: int, depth: int, learning: bool) -> int:
    """The last tick of a segment at which ``stage`` has work (-1 if it has none)."""
    if num_samples <= 0:
        return -1
    last_forward = num_samples - 1 + stage
    if not learning:
        return last_forward
    return max(last_forward, num_samples - 1 + 2 * (depth - 1) - stage)


def clock(num_samples: int, depth: int, learning: bool) -> Iterator[tuple[str, ...]]:
    """Each tick of a segment as one string per stage: ``"F3"``, ``"F3 B1"``, ``"B5"`` or ``""``.

    This is the table in the module docstring; executors follow ``forward_sample`` and
    ``backward_sample``, and tests compare this with literal tables.
    """
    for tick in range(segment_ticks(num_samples, depth, learning)):
        row = []
        for stage in range(depth):
            parts = []
            f = forward_sample(stage, tick, num_samples)
            if f is not None:
                parts.append(f"F{f}")
            b = backward_sample(stage, tick, depth, num_samples) if learning else None
            if b is not None:
                parts.append(f"B{b}")
            row.append(" ".join(parts))
        yield tuple(row)


def _exists(sample: int, num_samples: int | None) -> bool:
    return sample >= 0 and (num_samples is None or sample < num_samples)
