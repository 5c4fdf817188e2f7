"""partime.video: a generated clip written with write_video comes back from video_frames."""

import gc
import sys

import pytest
import torch

from partime.sources import video_frames, write_video

pytest.importorskip("av")

FRAMES, HEIGHT, WIDTH = 24, 32, 48
BACKGROUND, SQUARE = (0.05, 0.1, 0.2), (0.95, 0.6, 0.2)  # dark blue, orange: R, G and B all differ


def square_at(k):
    """Top-left corner (row, column) of the 8 x 8 square in frame ``k``: it moves right and down."""
    return 3 + k // 2, 1 + k


def clip():
    frames = torch.empty(FRAMES, 3, HEIGHT, WIDTH)
    frames[:] = torch.tensor(BACKGROUND).view(3, 1, 1)
    for k in range(FRAMES):
        row, col = square_at(k)
        frames[k, :, row : row + 8, col : col + 8] = torch.tensor(SQUARE).view(3, 1, 1)
    return frames


def bounding_box(frame):
    """(top, left, bottom, right) of the pixels whose red is above one half: the square's."""
    rows, cols = (frame[0] > 0.5).nonzero(as_tuple=True)
    return rows.min().item(), cols.min().item(), rows.max().item(), cols.max().item()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("video") / "clip.mp4"
    frames = clip()
    # (1, 3, H, W) frames are squeezed: every other one is given as a batch of one
    count = write_video(path, (f.unsqueeze(0) if k % 2 else f for k, f in enumerate(frames)), fps=24)
    assert count == FRAMES
    return path, frames


def test_a_clip_comes_back_within_the_codec_tolerance(written):
    path, originals = written
    frames = list(video_frames(path))
    assert len(frames) == FRAMES
    assert all(f.shape == (3, HEIGHT, WIDTH) and f.dtype == torch.float32 for f in frames)
    decoded = torch.stack(frames)
    assert decoded.min() >= 0 and decoded.max() <= 1
    error = (decoded - originals).abs()
    # H.264 4:2:0 at the encoder's defaults measured 0.0115 overall and at most 0.0135 in a frame;
    # single pixels at the square's colour edges are off by up to 0.46 (colour at half resolution),
    # the square's inside by up to 0.09 (its channels differ by 0.35 or more: RGB in that order)
    assert error.mean() < 0.02
    assert error.flatten(1).mean(1).max() < 0.025
    for k, frame in enumerate(decoded):
        row, col = square_at(k)
        assert bounding_box(frame) == (row, col, row + 7, col + 7), k
        centre = frame[:, row + 2 : row + 6, col + 2 : col + 6].mean((1, 2))
        assert torch.allclose(centre, torch.tensor(SQUARE), atol=0.15), (k, centre)


def test_a_lossless_codec_comes_back_within_rounding(tmp_path):
    path, originals = tmp_path / "clip.mkv", clip()
    write_video(path, originals, codec="ffv1", pixel_format="bgr0")
    decoded = torch.stack(list(video_frames(path)))
    assert (decoded - originals).abs().max() <= 0.5 / 255 + 1e-6  # 8 bits, rounded


def test_frames_are_resized_to_the_size_asked_for(written):
    path, _ = written
    assert [f.shape for f in video_frames(path, size=(16, 24))] == [(3, 16, 24)] * FRAMES
    square = next(video_frames(path, size=16))
    assert square.shape == (3, 16, 16) and square.dtype == torch.float32


def test_closing_early_closes_the_file(written, monkeypatch):
    import av

    closed = []
    opened = av.open

    def spy(*args, **kwargs):
        container = opened(*args, **kwargs)
        real_close = container.close

        def close():
            closed.append(True)
            real_close()

        return _Closing(container, close)

    monkeypatch.setattr(av, "open", spy)
    frames = video_frames(written[0])
    assert next(frames).shape == (3, HEIGHT, WIDTH)
    frames.close()
    assert closed == [True]
    for _ in video_frames(written[0]):
        break
    gc.collect()
    assert closed == [True, True]
    assert len(list(video_frames(written[0]))) == FRAMES and closed == [True] * 3


class _Closing:
    """A container whose ``close`` is the given function; everything else is the container's."""

    def __init__(self, container, close):
        self._container, self.close = container, close

    def __getattr__(self, name):
        return getattr(self._container, name)


def test_missing_files_and_bad_sizes_are_named(tmp_path):
    missing = tmp_path / "nowhere.mp4"
    with pytest.raises(FileNotFoundError, match="no video at '.*nowhere.mp4': no such file or device"):
        next(video_frames(missing))
    text = tmp_path / "notes.txt"
    text.write_text("not a video")
    with pytest.raises(ValueError, match="cannot open '.*notes.txt' as a video"):
        next(video_frames(text))
    for size in (0, -3, 16.0, (16,), (16, 0), (16.0, 24), "16", True):
        with pytest.raises(ValueError, match=r"size must be a positive int or a \(height, width\) pair"):
            video_frames(missing, size=size)  # checked at the call, before anything is opened


def test_a_file_without_video_is_named(tmp_path):
    import av

    path = tmp_path / "tone.wav"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame(format="s16", layout="mono", samples=800)
        frame.planes[0].update(bytes(1600))
        frame.rate = 8000
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    with pytest.raises(ValueError, match="'.*tone.wav' holds no video stream"):
        next(video_frames(path))


def test_write_video_refuses_what_it_cannot_encode(tmp_path):
    path = tmp_path / "bad.mp4"
    with pytest.raises(ValueError, match="yuv420p .* needs a height divisible by 2 and a width by 2, not 31x48"):
        write_video(path, [torch.zeros(3, 31, 48)])
    with pytest.raises(ValueError, match=r"frame 1 is \(32, 40\) \(H, W\), frame 0 \(32, 48\)"):
        write_video(path, [torch.zeros(3, 32, 48), torch.zeros(3, 32, 40)])
    with pytest.raises(ValueError, match=r"frame 0 has shape \(32, 48\)"):
        write_video(path, [torch.zeros(32, 48)])
    with pytest.raises(ValueError, match="frame 0 is torch.uint8: give float tensors"):
        write_video(path, [torch.zeros(3, 32, 48, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="no frames to write"):
        write_video(path, [])
    with pytest.raises(ValueError, match="no 'nonesuch' encoder"):
        write_video(path, [torch.zeros(3, 32, 48)], codec="nonesuch")
    with pytest.raises(ValueError, match="fps must be"):
        write_video(path, [torch.zeros(3, 32, 48)], fps=0)


def test_without_pyav_it_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'partime\[video\]'"):
        video_frames(tmp_path / "clip.mp4")
    with pytest.raises(ImportError, match=r"pip install 'partime\[video\]'"):
        write_video(tmp_path / "clip.mp4", [torch.zeros(3, 32, 48)])
