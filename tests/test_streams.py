"""Tests of partime.streams: shapes, determinism, smoothness where claimed, laziness, offline data."""

from __future__ import annotations

import itertools
import math
import re
import socket
import sys
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch

from partime import streams
from partime.streams import moving_digits, next_frame_pairs, panning_camera, shuffled_digits, smoothness


def digit_frames(n: int, **kwargs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All frames [n, batch, 1, size, size] and labels [n, batch] of moving_digits(n, **kwargs)."""
    frames, labels = zip(*moving_digits(n, **kwargs))
    return torch.stack(frames), torch.stack(labels)


# --- helpers ------------------------------------------------------------------------------


def test_next_frame_pairs_and_smoothness_on_hand_cases() -> None:
    frames = [torch.tensor([0.0, 0.0]), torch.tensor([1.0, 0.0]), torch.tensor([1.0, 2.0])]
    pairs = list(next_frame_pairs(iter(frames)))
    assert len(pairs) == 2
    assert all(x is a and y is b for (x, y), a, b in zip(pairs, frames, frames[1:]))
    assert smoothness(frames) == 0.75  # mean of |[1, 0]| -> 0.5 and |[0, 2]| -> 1.0
    assert smoothness([torch.ones(3)] * 4) == 0.0
    assert math.isnan(smoothness([torch.ones(3)]))
    assert list(next_frame_pairs([])) == []


# --- moving digits --------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "batch"), [(24, 1), (32, 3)])
def test_moving_digits_shapes_dtypes_and_ranges(size: int, batch: int) -> None:
    frames, labels = digit_frames(50, size=size, batch=batch, hold=10)
    assert frames.shape == (50, batch, 1, size, size) and frames.dtype == torch.float32
    assert labels.shape == (50, batch) and labels.dtype == torch.int64
    assert frames.min() >= 0.0 and frames.max() <= 1.0
    assert labels.min() >= 0 and labels.max() <= 9
    # the digit is on the canvas in every frame, and never touches its border much
    assert frames.amax(dim=(2, 3, 4)).min() > 0.5
    border = torch.cat([frames[..., 0, :], frames[..., -1, :], frames[..., :, 0], frames[..., :, -1]], dim=-1)
    assert border.mean() < 0.01


def test_moving_digits_is_deterministic_from_the_seed() -> None:
    a_frames, a_labels = digit_frames(60, seed=3, batch=2)
    b_frames, b_labels = digit_frames(60, seed=3, batch=2)
    assert torch.equal(a_frames, b_frames) and torch.equal(a_labels, b_labels)
    c_frames, _ = digit_frames(60, seed=4, batch=2)
    assert not torch.equal(a_frames, c_frames)
    # each row is its own stream: the rows differ, and row 0 does not depend on the batch size
    assert not torch.equal(a_frames[:, 0], a_frames[:, 1])
    alone, alone_labels = digit_frames(60, seed=3, batch=1)
    assert torch.equal(alone[:, 0], a_frames[:, 0]) and torch.equal(alone_labels[:, 0], a_labels[:, 0])


def test_moving_digits_holds_each_digit_and_changes_digit_between_holds() -> None:
    frames, labels = digit_frames(200, hold=20, seed=1)
    holds = labels[:, 0].reshape(10, 20)
    assert (holds == holds[:, :1]).all()
    # the image changes at every hold boundary (even where the label repeats); within a hold it moves
    jumps = (frames[20::20] - frames[19:-1:20]).abs().mean(dim=(1, 2, 3, 4))
    steps = (frames[1:] - frames[:-1]).abs().mean(dim=(1, 2, 3, 4))
    assert jumps.min() > 2 * steps.reshape(-1)[torch.arange(199) % 20 != 19].max()
    assert steps.min() > 0


def test_moving_digits_is_smooth_within_holds_unlike_shuffled() -> None:
    n, hold = 400, 40
    frames, _ = digit_frames(n, hold=hold)
    within = [smoothness(frames[start : start + hold]) for start in range(0, n, hold)]
    shuffled = smoothness(x for x, _ in shuffled_digits(n, hold=hold))
    assert max(within) < shuffled / 3
    assert sum(within) / len(within) < shuffled / 10


def test_shuffled_digits_holds_the_same_rows_in_another_order() -> None:
    moving = list(moving_digits(90, seed=2, hold=15, batch=2))
    shuffled = list(shuffled_digits(90, seed=2, hold=15, batch=2))
    assert len(shuffled) == 90
    assert all(x.shape == (2, 1, 24, 24) and y.shape == (2,) and y.dtype == torch.int64 for x, y in shuffled)

    def rows(stream: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[bytes, int]]:
        return [(x[i].numpy().tobytes(), int(y[i])) for x, y in stream for i in range(len(y))]

    assert Counter(rows(shuffled)) == Counter(rows(moving))
    assert rows(shuffled) != rows(moving)
    again = list(shuffled_digits(90, seed=2, hold=15, batch=2))
    assert all(torch.equal(x, a) and torch.equal(y, b) for (x, y), (a, b) in zip(shuffled, again))
    other = list(shuffled_digits(90, seed=5, hold=15, batch=2))
    assert rows(other) != rows(shuffled)


def test_digit_streams_check_their_arguments_when_called() -> None:
    for stream in (moving_digits, shuffled_digits):
        with pytest.raises(ValueError, match="n must be a whole number of at least 0, got -1"):
            stream(-1)
        with pytest.raises(ValueError, match="hold must be a whole number of at least 1, got 0"):
            stream(5, hold=0)
        with pytest.raises(ValueError, match="size must be a whole number of at least 8, got 4"):
            stream(5, size=4)
        with pytest.raises(ValueError, match="batch must be a whole number of at least 1, got 0"):
            stream(5, batch=0)
    assert list(moving_digits(0)) == [] and list(shuffled_digits(0)) == []


# --- panning camera ---------------------------------------------------------------------------


def test_panning_camera_shapes_dtypes_and_ranges() -> None:
    frames = torch.stack(list(panning_camera(30, size=20, batch=2)))
    assert frames.shape == (30, 2, 3, 20, 20) and frames.dtype == torch.float32
    assert frames.min() >= 0.0 and frames.max() <= 1.0
    assert frames.std() > 0.05  # a photograph, not a flat colour


def test_panning_camera_is_deterministic_from_the_seed() -> None:
    a = torch.stack(list(panning_camera(20, seed=7, batch=2)))
    assert torch.equal(a, torch.stack(list(panning_camera(20, seed=7, batch=2))))
    assert not torch.equal(a, torch.stack(list(panning_camera(20, seed=8, batch=2))))
    assert not torch.equal(a[:, 0], a[:, 1])
    assert torch.equal(a[:, 0], torch.stack(list(panning_camera(20, seed=7, batch=1)))[:, 0])


def test_panning_camera_is_smooth_and_moves_with_speed() -> None:
    slow = list(panning_camera(300, speed=0.25))
    fast = list(panning_camera(300, speed=2.0))
    assert 0 < smoothness(slow) < smoothness(fast)
    assert smoothness(panning_camera(300)) < 0.05
    assert max(float((b - a).abs().mean()) for a, b in next_frame_pairs(slow)) < 0.05
    # the window keeps moving: far frames differ much more than neighbours
    assert float((slow[-1] - slow[0]).abs().mean()) > 3 * smoothness(slow)


def test_panning_camera_checks_its_arguments_when_called() -> None:
    with pytest.raises(ValueError, match="size must be a whole number from 1 to 106 pixels, got 200"):
        panning_camera(5, size=200)
    with pytest.raises(ValueError, match="speed must be above 0"):
        panning_camera(5, speed=0.0)
    with pytest.raises(ValueError, match="seed must be a whole number of at least 0, got -2"):
        panning_camera(5, seed=-2)


# --- laziness and offline data -------------------------------------------------------------------


def test_smooth_streams_are_lazy() -> None:
    """Taking a few frames of an endless-looking stream makes only those (else this test hangs)."""
    digits = list(itertools.islice(moving_digits(10**9, batch=2), 5))
    frames = list(itertools.islice(panning_camera(10**9), 5))
    assert len(digits) == 5 and len(frames) == 5
    assert torch.equal(digits[4][0], list(moving_digits(5, batch=2))[4][0])


def test_data_ships_with_scikit_learn(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("a stream tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    streams._digits.cache_clear()
    streams._photos.cache_clear()
    images, labels = streams._digits()
    photos = streams._photos()
    assert images.shape == (1797, 1, 16, 16) and labels.shape == (1797,)
    assert Counter(labels.tolist()).keys() == set(range(10))
    assert photos.shape == (2, 3, 107, 160)


@pytest.mark.parametrize(
    ("blocked", "stream"), [(("sklearn", "sklearn.datasets"), moving_digits), (("PIL",), panning_camera)]
)
def test_streams_without_their_data_readers_say_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, blocked: tuple[str, ...], stream: Callable[[int], Iterator[object]]
) -> None:
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` fail as if it were not installed
    streams._digits.cache_clear()
    streams._photos.cache_clear()
    with pytest.raises(ImportError, match=re.escape("pip install partime[tools]")) as caught:
        next(stream(1))
    assert blocked[0] in str(caught.value)
