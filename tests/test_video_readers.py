"""Video readers (data.decoder): PyAV, used where decord has no wheel (Linux aarch64, macOS arm64),
returns decord's frames to the last pixel; the reader in use is chosen, refused and named once."""
from __future__ import annotations

import logging
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dit_train.data_pipelines.video_io as video_io
import dit_train.data_pipelines.video_readers as readers
from dit_train.data_pipelines.synthetic_video import write_mp4
from dit_train.data_pipelines.video_io import VideoReadError, frame_indices
from tests.conftest import TINY, compose_config

FPS = 8


@pytest.fixture(autouse=True)
def _auto_decoder_after():
    """use_decoder is per process: put the default back (and forget what was importable)."""
    yield
    readers.import_problem.cache_clear()
    video_io._decoder = "auto"


def _hide(monkeypatch, module: str) -> None:
    """`import module` fails from now on in this test (a None entry in sys.modules raises ImportError)."""
    monkeypatch.setitem(sys.modules, module, None)
    readers.import_problem.cache_clear()


def _encode(path: Path, frames: np.ndarray, codec: str, pix_fmt: str, options: dict) -> Path:
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=FPS)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], pix_fmt
        stream.options = options
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def _content(n: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    """A horizontal ramp (smooth), a noisy green channel (every pixel differs) and a blue level
    that changes every frame (a frame read out of order shows)."""
    rng = np.random.default_rng(seed)
    x = np.empty((n, h, w, 3), np.uint8)
    x[..., 0] = np.linspace(0, 255, w, dtype=np.float32).astype(np.uint8)
    x[..., 1] = rng.integers(0, 256, (n, h, w))
    x[..., 2] = (np.arange(n) * 37 % 256)[:, None, None]
    return x


# (file, codec, pixel format, encoder options): B-frames and a short GOP (decord seeks to key
# frames; PyAV decodes in order), other containers and codecs, chroma layouts, full-range JPEG
FORMATS = [
    ("h264_bframes.mp4", "libx264", "yuv420p", {"crf": "20", "g": "5", "bf": "3"}),
    ("vp9.webm", "libvpx-vp9", "yuv420p", {}),
    ("mpeg4.avi", "mpeg4", "yuv420p", {}),
    ("mjpeg.mov", "mjpeg", "yuvj420p", {}),
    ("h264_444.mp4", "libx264", "yuv444p", {"crf": "12"}),
    ("h264_422.mkv", "libx264", "yuv422p", {"crf": "12"}),
]


def _both(path: str, indices_of=lambda info: list(range(info.frames))):
    """(info, frames) read with decord and with PyAV."""
    out = []
    for reader in (readers.DecordReader(), readers.PyAVReader()):
        info = reader.probe(path)
        out.append((info, reader.read(path, indices_of(info), info)))
    return out


@pytest.mark.parametrize("name,codec,pix_fmt,options", FORMATS, ids=[f[0] for f in FORMATS])
def test_pyav_reads_decords_frames_to_the_last_pixel(tmp_path, name, codec, pix_fmt, options):
    path = str(_encode(tmp_path / name, _content(30, 32, 64), codec, pix_fmt, options))
    (info_d, frames_d), (info_a, frames_a) = _both(path)
    assert info_a == info_d and info_a.frames == 30 and info_a.fps == FPS
    assert frames_a.shape == (30, 32, 64, 3) and frames_a.dtype == torch.uint8
    assert torch.equal(frames_a, frames_d)
    # frames picked by data.fps / stride (repeats, holes), and out of order with repeats: decord
    # seeks to a key frame for each, PyAV decodes 0..max in order; the same frame either way
    for pick in (frame_indices(30, FPS, 3.0, 1, 16), frame_indices(30, FPS, 0.0, 3, 4, 2), [29, 3, 3, 17, 0, 11]):
        assert torch.equal(readers.PyAVReader().read(path, pick, info_a), readers.DecordReader().read(path, pick, info_d))


def test_the_embedded_clips_read_the_same(tiny_cfg):
    from dit_train.data_pipelines.synthetic_video import dataset_dir

    c = tiny_cfg.data
    clips = sorted(dataset_dir(c.cache_dir, c.num_clips, c.gen_seed, c.num_images, c.widths, c.heights, c.frames,
                      c.heldout_compositions).glob("*.mp4"))
    assert len(clips) == c.num_clips
    for clip in clips[:8]:
        (info_d, frames_d), (info_a, frames_a) = _both(str(clip))
        assert info_a == info_d and torch.equal(frames_a, frames_d), clip.name


_IDENTITY = struct.pack(">9i", 0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x40000000)


def _rotated(src: Path, dst: Path, clockwise: int) -> Path:
    """`src` with the display rotation phones write (the track header's matrix), `clockwise` degrees."""
    a, b, c, d = {90: (0, 1, -1, 0), 180: (-1, 0, 0, -1), 270: (0, -1, 1, 0)}[clockwise]
    data = src.read_bytes()
    at = data.index(_IDENTITY, data.index(b"tkhd"))
    matrix = struct.pack(">9i", a * 0x10000, b * 0x10000, 0, c * 0x10000, d * 0x10000, 0, 0, 0, 0x40000000)
    dst.write_bytes(data[:at] + matrix + data[at + len(_IDENTITY):])
    return dst


@pytest.mark.parametrize("clockwise", [90, 180, 270])
def test_rotated_phone_videos_are_turned_upright_as_decord_does(tmp_path, clockwise):
    frames = _content(6, 32, 64) // 4  # dark: only the block below is bright red
    frames[:, :8, :16] = (255, 0, 0)  # a red block in the stored top-left corner
    src = tmp_path / "stored.mp4"
    write_mp4(src, frames)
    path = str(_rotated(src, tmp_path / f"turned{clockwise}.mp4", clockwise))
    (info_d, frames_d), (info_a, frames_a) = _both(path)
    assert info_a == info_d
    assert (info_a.height, info_a.width) == ((64, 32) if clockwise != 180 else (32, 64))
    assert torch.equal(frames_a, frames_d)
    red = (frames_a[0, ..., 0] > 200) & (frames_a[0, ..., 1] < 60)
    rows, cols = red.nonzero().float().mean(0).tolist()
    corner = {90: (8, 28), 180: (28, 56), 270: (56, 4)}[clockwise]  # where clockwise turns put the block
    assert abs(rows - corner[0]) < 2 and abs(cols - corner[1]) < 2, (rows, cols)


@pytest.mark.parametrize("width", [48, 72])
def test_widths_decord_garbles_are_exact_with_pyav(tmp_path, width):
    """decord 0.6 has the wrong row stride at these widths; its workaround (decode 32-aligned,
    resize back) is an approximation, PyAV decodes them as they are."""
    frames = _content(4, 32, width)
    frames[..., 1] = 128  # smooth: a ramp, a flat green, a per-frame blue level
    path = tmp_path / f"w{width}.mp4"
    write_mp4(path, frames)
    (info_d, frames_d), (info_a, frames_a) = _both(str(path))
    assert info_a == info_d and frames_a.shape == frames_d.shape == (4, 32, width, 3)
    # PyAV: within the codec's error of the source; decord's resampled frames: near PyAV's
    src = torch.from_numpy(frames).int()
    assert (frames_a.int() - src).abs().float().mean() < 2
    assert (frames_a.int() - frames_d.int()).abs().float().mean() < 2  # measured 1.26 (48 px), 0.94 (72 px)


def test_corrupt_and_truncated_files_are_read_errors(tmp_path):
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    with pytest.raises(VideoReadError, match="broken.mp4"):
        readers.PyAVReader().probe(str(broken))
    path = tmp_path / "ok.mp4"
    write_mp4(path, _content(8, 32, 32))
    info = readers.PyAVReader().probe(str(path))
    with pytest.raises(VideoReadError, match="frame 9 was asked for but the file decodes to 8 frames"):
        readers.PyAVReader().read(str(path), [0, 9], info)


def test_the_dataset_reads_the_same_clips_with_decord_hidden(tiny_cfg, monkeypatch, caplog):
    """The data tests' path (source -> VideoClipDataset -> read_frames) on a machine without
    decord: auto picks PyAV, says so once, and every sample's pixels equal decord's."""
    from dit_train.data_pipelines import open_dataset, prepare_data

    ds = open_dataset(tiny_cfg.data, tiny_cfg.model)
    assert video_io._decoder == "decord"
    lengths, reference = ds.lengths(), [ds[i].pixels for i in range(len(ds))]  # read now: the reader is per process
    cfg = compose_config([*TINY, "data.decoded_cache_items=0"], cache_dir=tiny_cfg.data.cache_dir)
    _hide(monkeypatch, "decord")
    with caplog.at_level(logging.INFO, logger="dit_train.data_pipelines.video_source"):
        prepare_data(cfg.data, cfg.model)
    notes = [r.getMessage() for r in caplog.records if "videos are read with" in r.getMessage()]
    assert len(notes) == 1 and "PyAV" in notes[0] and "decord is not installed" in notes[0], notes
    without = open_dataset(cfg.data, cfg.model)
    assert video_io._decoder == "pyav"
    assert without.lengths() == lengths
    for i in range(len(without)):
        assert torch.equal(without[i].pixels, reference[i]), i


def test_a_reader_that_cannot_load_is_refused_or_passed_over(tiny_cfg, monkeypatch):
    """torchcodec's PyPI wheel imports with OSError where FFmpeg's libraries or a CUDA torch are
    missing: data.decoder=torchcodec is refused naming the key and the fix; auto never tries it."""
    from dit_train.data_pipelines import prepare_data

    def broken(name):
        raise OSError("Could not load this library: libtorchcodec_core7.so")

    real = readers.importlib.import_module
    monkeypatch.setattr(readers.importlib, "import_module", lambda name: broken(name) if name.startswith("torchcodec") else real(name))
    readers.import_problem.cache_clear()
    cfg = compose_config([*TINY, "data.decoder=torchcodec"], cache_dir=tiny_cfg.data.cache_dir)
    with pytest.raises(ValueError, match=r"data.decoder=torchcodec cannot be used here \(OSError: Could not load .*"
                                         r"pip install torchcodec .*or set data.decoder=auto"):
        prepare_data(cfg.data, cfg.model)
    _hide(monkeypatch, "decord")
    cfg = compose_config([*TINY, "data.decoder=decord"], cache_dir=tiny_cfg.data.cache_dir)
    with pytest.raises(ValueError, match="data.decoder=decord cannot be used here .*x86_64 Linux and Windows only"):
        prepare_data(cfg.data, cfg.model)
    assert video_io.use_decoder("auto").startswith("videos are read with PyAV")


def test_the_cli_refuses_a_missing_reader_in_one_line(tmp_path, data_cache):
    """What a user sees: `error: data.decoder=... ` on stderr, exit 1, before anything runs: the
    CLI's path (run_from_config) raises it as one ConfigError before the run folder is written.
    In this process: the CLI prints every ConfigError of run_from_config as one `error:` line with
    one `except`, run in a fresh Python by test_cli's test_bad_override_fails_before_running."""
    from dit_train.config.errors import ConfigError
    from tests.conftest import train_in_process

    if not readers.import_problem("torchcodec"):
        pytest.skip("torchcodec imports here: nothing to refuse")
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        train_in_process([*TINY, "data.decoder=torchcodec"], run, cache_dir=data_cache)
    assert "\n" not in str(err.value) and "data.decoder=torchcodec cannot be used here" in str(err.value)
    assert not (run / "config.yaml").exists()


def test_torchcodec_reads_decords_frames_where_it_loads(tmp_path):
    """Runs where torchcodec loads (its PyPI wheel for x86_64 Linux needs a CUDA torch); skipped
    elsewhere."""
    if readers.import_problem("torchcodec"):
        pytest.skip(f"torchcodec does not load here: {readers.import_problem('torchcodec')}")
    path = str(_encode(tmp_path / "b.mp4", _content(20, 32, 64), *FORMATS[0][1:]))
    d, t = readers.DecordReader(), readers.TorchcodecReader()
    info = t.probe(path)
    assert info == d.probe(path)
    pick = [19, 3, 3, 0, 11]
    assert torch.equal(t.read(path, pick, info), d.read(path, pick, info))


def test_decord_loads_after_pyav_so_pyav_keeps_its_own_codecs(tmp_path):
    """decord puts its bundled FFmpeg 4 libraries (libvpx...) in the global symbol scope; had it
    loaded first, PyAV's VP9 encoder would bind to them and fail to open. A fresh process, as a
    worker starts: pick decord, then encode VP9 with PyAV."""
    import subprocess

    code = ("import sys; from pathlib import Path\n"
            "from dit_train.data_pipelines.video_readers import resolve\n"
            "assert resolve('decord')[0] == 'decord'\n"
            "from tests.test_video_readers import _content, _encode\n"
            "_encode(Path(sys.argv[1]), _content(4, 32, 64), 'libvpx-vp9', 'yuv420p', {})\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "v.webm")], cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-1500:]
