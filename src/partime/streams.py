"""Streams made from real data that ships inside scikit-learn: nothing is downloaded at run time.

The data needs the tools extra (scikit-learn, and Pillow for the photographs): ``pip install
partime[tools]``. It is imported when a stream first reads it, so importing this module needs
neither, and a stream without them raises an ImportError that says so.

Every stream is a lazy generator, and the same arguments (seed included) give the same tensors;
another seed gives others. Frames are float32 in [0, 1] with a leading batch dimension.

- ``moving_digits``: handwritten 8×8 digits drawn larger on a canvas; each digit is held for
  ``hold`` frames while it drifts, turns and grows or shrinks smoothly. Frames within a hold
  are close; where the digit changes the frame jumps. The label is the digit (classification).
- ``shuffled_digits``: the same frames and labels in a seeded random order, the i.i.d. control
  where consecutive samples are not alike.
- ``panning_camera``: a window gliding over scikit-learn's two sample photographs, with no
  labels. Learn it by next-frame prediction: ``next_frame_pairs`` turns it into pairs
  ``(frame_t, frame_{t+1})`` to use as (sample, target) with a loss such as ``F.mse_loss``;
  or reconstruct, with each frame as its own target.

``smoothness`` measures how alike consecutive frames are, for tests and tables.

>>> from partime.streams import moving_digits, smoothness
>>> frames = [x for x, _ in moving_digits(3, seed=1)]
>>> frames[0].shape, frames[0].dtype
(torch.Size([1, 1, 24, 24]), torch.float32)
>>> smoothness(frames) < 0.05
True
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["moving_digits", "next_frame_pairs", "panning_camera", "shuffled_digits", "smoothness"]

# Drawn 16×16 (twice the 8×8 original, bilinear) before being placed on the canvas, so that the
# canvas is sampled from a smooth picture rather than from 64 blocks.
_DIGIT_SIDE = 16
# A digit at scale 1 spans this fraction of the canvas side (12 of 24 pixels).
_DIGIT_SPAN = 0.5
# Half-ranges of the motion of a digit: centre offset (fraction of the canvas half-side),
# angle (radians) and log-scale. At the largest scale and angle the digit stays on the canvas.
_SHIFT, _ANGLE, _LOG_SCALE = 0.25, 0.5, 0.15
# Periods of each motion, in frames: slow enough that one frame moves a digit by under a pixel.
_PERIODS = (60.0, 180.0)
# The photographs are shrunk 4× (427×640 to 107×160) once; the window glides over those.
_PHOTO_SHRINK = 4
# Tags that keep the random streams of rows, the shuffle and the camera apart for one seed.
_DIGITS_TAG, _SHUFFLE_TAG, _CAMERA_TAG = 0, 1, 2


def _missing(package: str, error: ImportError) -> ImportError:
    """The error for data whose reader is not installed: what is missing, and how to install it."""
    return ImportError(
        f"partime.streams reads its data with {package}, which could not be imported ({error}): "
        "pip install partime[tools]"
    )


@functools.cache
def _digits() -> tuple[Tensor, Tensor]:
    """Every bundled digit drawn 16×16 in [0, 1] ([1797, 1, 16, 16]) and its label ([1797])."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise _missing("scikit-learn", error) from error

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(_DIGIT_SIDE, _DIGIT_SIDE), mode="bilinear", align_corners=False)
    return images.clamp_(0.0, 1.0), torch.tensor(data.target, dtype=torch.int64)


@functools.cache
def _photos() -> Tensor:
    """scikit-learn's sample photographs, shrunk 4× with antialiasing: [2, 3, 107, 160] in [0, 1]."""
    try:
        import PIL  # noqa: F401  (scikit-learn decodes the JPEG files with Pillow, and says so only when asked to)
        from sklearn.datasets import load_sample_images
    except ImportError as error:
        raise _missing("scikit-learn and Pillow", error) from error

    images = np.stack(load_sample_images().images)  # [2, 427, 640, 3] uint8
    photos = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0
    height, width = photos.shape[-2:]
    size = (round(height / _PHOTO_SHRINK), round(width / _PHOTO_SHRINK))
    photos = F.interpolate(photos, size=size, mode="bilinear", antialias=True, align_corners=False)
    return photos.clamp_(0.0, 1.0).contiguous()


def _whole(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be a whole number of at least {least}, got {value!r}")


def _check_digits(n: int, seed: int, size: int, hold: int, batch: int) -> None:
    checks = (("n", n, 0), ("seed", seed, 0), ("size", size, 8), ("hold", hold, 1), ("batch", batch, 1))
    for name, value, least in checks:
        _whole(name, value, least)


class _Paths:
    """Smooth bounded paths ``centre + Σⱼ aⱼ sin(ωⱼ t + φⱼ)``, many at once, with smooth turns.

    ``amplitudes``, ``omegas`` and ``phases`` have the shape of ``centre`` plus one last axis of terms;
    a path moves at most ``Σⱼ |aⱼ ωⱼ|`` per frame and stays within ``Σⱼ |aⱼ|`` of its centre.
    """

    def __init__(self, centre: np.ndarray, amplitudes: np.ndarray, omegas: np.ndarray, phases: np.ndarray):
        self.centre, self.amplitudes, self.omegas, self.phases = centre, amplitudes, omegas, phases

    def __call__(self, t: int) -> np.ndarray:
        terms = self.amplitudes * np.sin(self.omegas * t + self.phases)
        position: np.ndarray = self.centre + np.sum(terms, axis=-1)  # np.sum is typed Any
        return position


def _digit_paths(rngs: list[np.random.Generator]) -> _Paths:
    """Paths of the centre (x, y), angle and log-scale of one held digit per row, each in its half-range."""
    half_ranges = np.array([_SHIFT, _SHIFT, _ANGLE, _LOG_SCALE])
    terms = []
    for rng in rngs:
        amplitudes = (half_ranges * rng.uniform(0.5, 1.0, size=4))[:, None] * np.array([0.7, 0.3])
        omegas = 2 * math.pi / rng.uniform(*_PERIODS, size=(4, 2))
        terms.append((amplitudes, omegas, rng.uniform(0, 2 * math.pi, size=(4, 2))))
    amplitudes, omegas, phases = (np.stack(arrays) for arrays in zip(*terms))
    return _Paths(np.zeros((len(rngs), 4)), amplitudes, omegas, phases)


def _digit_theta(pose: np.ndarray) -> Tensor:
    """Maps from canvas to digit coordinates [rows, 2, 3] for poses [rows, 4] (x, y, angle, log-scale)."""
    x, y, angle, log_scale = pose.T
    zoom = 1.0 / (_DIGIT_SPAN * np.exp(log_scale))
    cos, sin = np.cos(angle) * zoom, np.sin(angle) * zoom
    # The digit's point p is drawn at canvas point (x, y) + R(angle) p / zoom; this is the inverse.
    theta = np.stack([np.stack([cos, sin, -(cos * x + sin * y)]), np.stack([-sin, cos, sin * x - cos * y])])
    return torch.from_numpy(theta.transpose(2, 0, 1)).float()


def moving_digits(
    n: int, *, seed: int = 0, size: int = 24, hold: int = 40, batch: int = 1
) -> Iterator[tuple[Tensor, Tensor]]:
    """``n`` frames ``[batch, 1, size, size]`` (float32 in [0, 1]) of moving digits, with labels ``[batch]``.

    Each row of the batch is its own stream: a bundled digit, picked at random, is held for
    ``hold`` frames (holds start together in every row) while its position, angle (within ±0.5 rad)
    and scale (within ±15 %) follow smooth paths with periods of 60 to 180 frames; then the next
    digit comes. Frames are made one at a time, when asked for. The label of a row is its digit.
    """
    _check_digits(n, seed, size, hold, batch)
    return _moving_digits(n, seed, size, hold, batch)


def _moving_digits(n: int, seed: int, size: int, hold: int, batch: int) -> Iterator[tuple[Tensor, Tensor]]:
    images, labels = _digits()
    rngs = [np.random.default_rng([seed, _DIGITS_TAG, row]) for row in range(batch)]
    for t in range(n):
        if t % hold == 0:
            picks = torch.tensor([int(rng.integers(len(labels))) for rng in rngs], dtype=torch.int64)
            paths = _digit_paths(rngs)
        theta = _digit_theta(paths(t % hold))
        grid = F.affine_grid(theta, [batch, 1, size, size], align_corners=False)
        frame = F.grid_sample(images[picks], grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        yield frame.clamp_(0.0, 1.0), labels[picks]


def shuffled_digits(
    n: int, *, seed: int = 0, size: int = 24, hold: int = 40, batch: int = 1
) -> Iterator[tuple[Tensor, Tensor]]:
    """The rows of ``moving_digits`` (same arguments) in a seeded random order: the i.i.d. control.

    All ``n × batch`` (frame, label) rows are made first (``n × batch × size²`` floats), shuffled
    across time and batch, and dealt out again ``batch`` at a time: the same frames and labels,
    with no order left between consecutive samples.
    """
    _check_digits(n, seed, size, hold, batch)
    return _shuffled_digits(n, seed, size, hold, batch)


def _shuffled_digits(n: int, seed: int, size: int, hold: int, batch: int) -> Iterator[tuple[Tensor, Tensor]]:
    frames = torch.empty(n * batch, 1, size, size)
    labels = torch.empty(n * batch, dtype=torch.int64)
    for t, (x, y) in enumerate(moving_digits(n, seed=seed, size=size, hold=hold, batch=batch)):
        frames[t * batch : (t + 1) * batch] = x
        labels[t * batch : (t + 1) * batch] = y
    order = torch.from_numpy(np.random.default_rng([seed, _SHUFFLE_TAG]).permutation(n * batch))
    for t in range(n):
        rows = order[t * batch : (t + 1) * batch]
        yield frames[rows], labels[rows]


def _camera_paths(rngs: list[np.random.Generator], free: tuple[int, int], speed: float) -> _Paths:
    """Paths of the window's corner (top, left) per row, within ``[0, free]`` pixels on each axis.

    Two sines per axis whose speeds add up to ``speed`` pixels per frame; the second turns 1.5 to
    3 times faster, so the path does not soon repeat.
    """
    terms = []
    for rng in rngs:
        share = rng.uniform(0.55, 0.8, size=2)
        amplitudes = np.array(free)[:, None] / 2 * np.stack([share, 1.0 - share], axis=-1)
        ratio = rng.uniform(1.5, 3.0, size=2)
        omega = speed / (amplitudes[:, 0] + amplitudes[:, 1] * ratio)
        omegas = np.stack([omega, omega * ratio], axis=-1)
        terms.append((amplitudes, omegas, rng.uniform(0, 2 * math.pi, size=(2, 2))))
    amplitudes, omegas, phases = (np.stack(arrays) for arrays in zip(*terms))
    return _Paths(np.array(free, dtype=np.float64) / 2, amplitudes, omegas, phases)


def _window(photo: Tensor, top: float, left: float, size: int) -> Tensor:
    """The ``size × size`` window of ``photo`` at a fractional corner, interpolated bilinearly."""
    height, width = photo.shape[-2:]
    row, col = min(int(top), height - size - 1), min(int(left), width - size - 1)
    dy, dx = top - row, left - col
    patch = photo[:, row : row + size + 1, col : col + size + 1]
    rows = patch[:, :-1] * (1 - dy) + patch[:, 1:] * dy
    return rows[:, :, :-1] * (1 - dx) + rows[:, :, 1:] * dx


def panning_camera(n: int, *, seed: int = 0, size: int = 32, batch: int = 1, speed: float = 0.5) -> Iterator[Tensor]:
    """``n`` frames ``[batch, 3, size, size]`` (float32 in [0, 1]) of a camera panning over a photograph.

    Each row of the batch is its own camera over one of the two bundled photographs (shrunk to
    107×160), picked at random: a window whose corner follows a smooth path that stays inside
    the photograph, moving at most ``speed`` pixels per frame along each axis, sub-pixel and
    interpolated bilinearly. There are no labels: use ``next_frame_pairs`` for next-frame
    prediction. Frames are made one at a time, when asked for.
    """
    for name, value, least in (("n", n, 0), ("seed", seed, 0), ("batch", batch, 1)):
        _whole(name, value, least)
    photos = _photos()
    height, width = photos.shape[-2:]
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size < min(height, width):
        most = min(height, width) - 1
        raise ValueError(f"size must be a whole number from 1 to {most} pixels, got {size!r}")
    if not 0 < speed <= size:
        raise ValueError(f"speed must be above 0 and at most size ({size}) pixels per frame, got {speed!r}")
    return _panning_camera(photos, n, seed, size, batch, speed)


def _panning_camera(photos: Tensor, n: int, seed: int, size: int, batch: int, speed: float) -> Iterator[Tensor]:
    height, width = photos.shape[-2:]
    rngs = [np.random.default_rng([seed, _CAMERA_TAG, row]) for row in range(batch)]
    picks = [int(rng.integers(len(photos))) for rng in rngs]
    paths = _camera_paths(rngs, (height - size, width - size), speed)
    for t in range(n):
        corners = paths(t).tolist()
        yield torch.stack([_window(photos[p], top, left, size) for p, (top, left) in zip(picks, corners)])


def next_frame_pairs(frames: Iterable[Tensor]) -> Iterator[tuple[Tensor, Tensor]]:
    """``(frame_t, frame_{t+1})`` for each consecutive pair, lazily: (sample, target) for next-frame learning.

    >>> import torch
    >>> list(next_frame_pairs(torch.tensor([float(i)]) for i in range(3)))
    [(tensor([0.]), tensor([1.])), (tensor([1.]), tensor([2.]))]
    """
    return itertools.pairwise(frames)


def smoothness(frames: Iterable[Tensor]) -> float:
    """The mean absolute difference between consecutive frames (0 for a still stream).

    The mean is over every element of every consecutive pair; nan with fewer than two frames.

    >>> smoothness([torch.zeros(2), torch.ones(2), torch.ones(2)])
    0.5
    """
    total, pairs = 0.0, 0
    for previous, frame in next_frame_pairs(frames):
        total += float((frame - previous).abs().mean())
        pairs += 1
    return total / pairs if pairs else math.nan
