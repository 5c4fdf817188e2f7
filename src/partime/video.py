"""Video files and cameras as streams of frames, through PyAV (the ``video`` extra).

``video_frames`` decodes a file, or a camera through the platform's capture device, into RGB
tensors ``(3, H, W)`` in ``[0, 1]``; ``write_video`` encodes such frames into a file. PyAV is
imported when one of them is called, so the core library works without it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator, Mapping
from fractions import Fraction
from typing import TypeAlias

import numpy
import torch

PathLike: TypeAlias = "str | os.PathLike[str]"


def _require_av() -> None:
    """Raise an ImportError that says what to install where PyAV is missing."""
    try:
        import av  # noqa: F401
    except ImportError as err:
        raise ImportError("reading and writing video needs PyAV: pip install 'partime[video]'") from err


def _frame_size(size: int | tuple[int, int] | None) -> tuple[int, int] | None:
    """``size`` as ``(height, width)``, or None; anything but positive whole numbers is refused."""
    if size is None:
        return None
    pair = (size, size) if isinstance(size, int) else tuple(size) if isinstance(size, (tuple, list)) else ()
    if len(pair) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in pair):
        raise ValueError(f"size must be a positive int or a (height, width) pair of them, not {size!r}")
    return pair[0], pair[1]


def video_frames(
    path: PathLike,
    size: int | tuple[int, int] | None = None,
    *,
    format: str | None = None,
    options: Mapping[str, str] | None = None,
) -> Iterator[torch.Tensor]:
    """Every frame of the video at ``path``, in order, as a float32 RGB tensor ``(3, H, W)`` with
    values in ``[0, 1]``; resized by FFmpeg's scaler to ``size`` (an int for a square, or
    ``(height, width)``) if one is given.

    ``format`` and ``options`` go to ``av.open`` (FFmpeg's input format and its options), which
    makes a camera the same call as a file; the camera's frames then come as it captures them:

    - Linux: ``video_frames("/dev/video0", format="v4l2", options={"video_size": "640x480"})``
    - macOS: ``video_frames("0", format="avfoundation", options={"framerate": "30"})``
    - Windows: ``video_frames("video=Integrated Camera", format="dshow")``

    ``size``, and that PyAV is installed, are checked at the call. The video is opened when the
    first frame is asked for: a path with nothing there raises ``FileNotFoundError`` then, and one
    that holds no video a ``ValueError``, each naming the path. The file or device is closed once
    the frames run out, decoding fails, or the iterator is closed (``close()``, or its garbage
    collection after a ``break``); one never started never opens it.
    """
    height_width = _frame_size(size)
    _require_av()
    return _decode(path, height_width, format, dict(options or {}))


def _decode(
    path: PathLike, size: tuple[int, int] | None, format: str | None, options: dict[str, str]
) -> Iterator[torch.Tensor]:
    import av

    try:
        container = av.open(os.fspath(path), format=format, options=options)
    except av.error.FileNotFoundError:
        raise FileNotFoundError(f"no video at {os.fspath(path)!r}: no such file or device") from None
    except av.error.FFmpegError as err:
        raise ValueError(f"cannot open {os.fspath(path)!r} as a video (format={format!r}): {err}") from err
    try:
        if not container.streams.video:
            raise ValueError(f"{os.fspath(path)!r} holds no video stream (only {list(container.streams)})")
        for frame in container.decode(container.streams.video[0]):
            if size is not None:
                frame = frame.reformat(width=size[1], height=size[0], format="rgb24")
            pixels = torch.from_numpy(frame.to_ndarray(format="rgb24"))  # (H, W, 3) uint8
            yield pixels.permute(2, 0, 1).to(torch.float32, memory_format=torch.contiguous_format) / 255
    finally:
        container.close()


def write_video(
    path: PathLike,
    frames: Iterable[torch.Tensor],
    fps: float = 30,
    *,
    codec: str = "libx264",
    pixel_format: str = "yuv420p",
    options: Mapping[str, str] | None = None,
) -> int:
    """Encode ``frames`` into a video file at ``path`` (its container chosen by the suffix, e.g.
    ``.mp4``, ``.mkv``), ``fps`` frames per second; return how many frames were written.

    Each frame is a float tensor ``(3, H, W)`` (or ``(1, 3, H, W)``, one sample of a batch) of RGB
    values in ``[0, 1]``; values outside are clipped, and each is stored with 8 bits. Every frame
    must have the first one's size. ``options`` go to the encoder (e.g. ``{"crf": "18"}``).

    The default, H.264 in 4:2:0 (``yuv420p``), plays nearly everywhere and is lossy: a moving
    coloured square on a dark field comes back with a mean absolute error of about 0.012, but
    pixels at a colour edge may be off by up to about 0.5, as colour is stored at half the
    resolution. 4:2:0 needs an even height and width; other sizes are refused with a
    ``ValueError`` (nothing is padded). For frames that come back within 8-bit rounding (0.002),
    use ``codec="ffv1", pixel_format="bgr0"`` into a ``.mkv`` (lossless), or
    ``pixel_format="yuv444p", options={"crf": "0"}`` with H.264 (within 0.005).
    """
    _require_av()
    import av

    if not isinstance(fps, (int, float)) or not 0 < fps < float("inf"):
        raise ValueError(f"fps must be a finite number of frames per second above 0, not {fps!r}")
    try:
        av.Codec(codec, "w")
    except av.codec.codec.UnknownCodecError:
        raise ValueError(
            f"this PyAV build has no {codec!r} encoder (it has libx264, mpeg4 and ffv1, among others)"
        ) from None
    frames = iter(frames)
    first = next(frames, None)
    if first is None:
        raise ValueError(f"no frames to write to {os.fspath(path)!r}")
    height, width = _image(first, 0).shape[1:]
    _check_subsampling(pixel_format, height, width)
    written = 0
    with av.open(os.fspath(path), "w") as container:
        rate = Fraction(fps).limit_denominator(1001)
        stream = container.add_stream(codec, rate=rate, options=dict(options or {}))
        stream.width, stream.height, stream.pix_fmt = width, height, pixel_format
        for index, frame in enumerate(itertools.chain([first], frames)):
            image = _image(frame, index)
            if image.shape[1:] != (height, width):
                raise ValueError(
                    f"frame {index} is {tuple(image.shape[1:])} (H, W), frame 0 {(height, width)}: they must match"
                )
            container.mux(stream.encode(av.VideoFrame.from_ndarray(_rgb24(image), format="rgb24")))
            written += 1
        container.mux(stream.encode(None))  # the frames the encoder still holds
    return written


def _image(frame: torch.Tensor, index: int) -> torch.Tensor:
    """Frame ``index`` as a ``(3, H, W)`` float tensor, or a ValueError that says what it is instead."""
    if not isinstance(frame, torch.Tensor) or not frame.is_floating_point():
        kind = frame.dtype if isinstance(frame, torch.Tensor) else type(frame).__name__
        raise ValueError(f"frame {index} is {kind}: give float tensors with values in [0, 1]")
    image = frame.squeeze(0) if frame.dim() == 4 and frame.shape[0] == 1 else frame
    if image.dim() != 3 or image.shape[0] != 3:
        raise ValueError(f"frame {index} has shape {tuple(frame.shape)}: give (3, H, W) or (1, 3, H, W) RGB frames")
    return image


def _rgb24(image: torch.Tensor) -> numpy.ndarray:
    """A ``(3, H, W)`` float image as ``(H, W, 3)`` uint8, values clipped to [0, 1] and rounded."""
    scaled = image.detach().to("cpu", torch.float32).clamp(0, 1).mul(255).round()
    return scaled.to(torch.uint8).permute(1, 2, 0).contiguous().numpy()


def _check_subsampling(pixel_format: str, height: int, width: int) -> None:
    """Refuse a size that ``pixel_format``'s chroma planes do not divide (4:2:0 wants it even)."""
    import av

    layout = av.VideoFormat(pixel_format)
    step_w, step_h = 16 // layout.chroma_width(16), 16 // layout.chroma_height(16)
    if width % step_w or height % step_h:
        raise ValueError(
            f"{pixel_format} stores colour per {step_h}x{step_w} pixels, so it needs a height divisible by "
            f"{step_h} and a width by {step_w}, not {height}x{width}: crop or pad the frames, or use "
            f'pixel_format="yuv444p"'
        )
