"""Video readers: decord where it has wheels, PyAV everywhere, torchcodec when chosen.

decord 0.6 (2021, the last release) ships wheels for x86_64 Linux and Windows only; GH200/GB200
nodes (Linux aarch64) and Apple Silicon have PyAV (`av`, a core dependency: it also writes the
embedded mp4s). Every reader answers like decord, the reference:

- frame count = the video stream's packets, frame i = the i-th in presentation order (decord
  indexes packets sorted by pts; PyAV and torchcodec's exact mode decode in that order);
- fps = the stream's average frame rate;
- frames are RGB uint8, turned upright by the file's display rotation (90/180/270 degrees,
  phone videos), as decord's filter graph does.

PyAV reads frames 0..max(indices) in one sequential pass (clips are sampled from their start,
see video_io.frame_indices), so no seek can land on another frame. Measured against decord on
H.264 (with B-frames), VP9, MPEG-4 part 2 and MJPEG, 8-bit 4:2:0/4:2:2/4:4:4, rotated files
and the embedded clips: the same pixels, to the last one (tests/test_video_readers.py). 10-bit
sources differ by the 10 -> 8 bit dither (both within ~2 levels of the source on average).
torchcodec (optional, `pip install torchcodec`; needs FFmpeg's shared libraries and a torch it
was built for) indexes frames the same way (exact seek mode); it is not compared here.
"""
from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

DECODERS = ("auto", "decord", "pyav", "torchcodec")


class VideoReadError(RuntimeError):
    """A file that cannot be opened or decoded (corrupt, truncated, not a video or image)."""


@dataclass(frozen=True)
class VideoInfo:
    frames: int
    height: int
    width: int
    fps: float


# the fix, when a chosen reader cannot be imported
_FIX = {
    "decord": "decord has wheels for x86_64 Linux and Windows only: set data.decoder=pyav (or auto)",
    "pyav": "pip install av, or set data.decoder=auto",
    "torchcodec": "pip install torchcodec (it also needs FFmpeg's shared libraries and the torch it was built "
                  "for), or set data.decoder=auto",
}
_MODULE = {"decord": "decord", "pyav": "av", "torchcodec": "torchcodec.decoders"}
_SHOWN = {"decord": "decord", "pyav": "PyAV", "torchcodec": "torchcodec"}


@functools.lru_cache(maxsize=None)
def import_problem(name: str) -> str:
    """'' if reader `name` can be imported here, else why not (one line). torchcodec's import
    loads native libraries and fails with OSError/RuntimeError, not only ImportError."""
    try:
        if name == "decord":
            _import_av_first()
        importlib.import_module(_MODULE[name])
    except Exception as e:  # ImportError, OSError (a missing libavcodec / libtorch_cuda), RuntimeError
        first = (str(e).strip().splitlines() or [""])[0]
        return f"{type(e).__name__}: {first}"[:300]
    return ""


def _import_av_first() -> None:
    """decord loads its bundled FFmpeg 4 libraries (libvpx, libx264...) into the process's global
    symbol scope; PyAV imported after it binds some unversioned symbols to them (its VP9 encoder
    then fails to open). Imported first, PyAV keeps its own. av is a core dependency."""
    try:
        import av  # noqa: F401
    except ImportError:
        pass


def resolve(choice: str) -> tuple[str, str]:
    """(reader name, one-line note saying which reader reads videos and why) for data.decoder.

    auto: decord where it imports, else PyAV (torchcodec only when chosen: it is the one reader
    not compared with decord here). Raises ValueError naming data.decoder when the chosen reader
    cannot be imported."""
    if choice not in DECODERS:
        raise ValueError(f"data.decoder={choice!r} must be one of {', '.join(DECODERS)}")
    if choice != "auto":
        why = import_problem(choice)
        if why:
            raise ValueError(f"data.decoder={choice} cannot be used here ({why}); {_FIX[choice]}")
        return choice, f"videos are read with {_SHOWN[choice]} (data.decoder={choice})"
    no_decord = import_problem("decord")
    if not no_decord:
        return "decord", "videos are read with decord (data.decoder=auto)"
    why = import_problem("pyav")
    if why:
        raise ValueError(f"data.decoder=auto finds no video reader: decord ({no_decord}), PyAV ({why}); pip install av")
    missing = "is not installed" if no_decord.startswith("ModuleNotFoundError") else f"cannot be imported ({no_decord})"
    return "pyav", (f"videos are read with PyAV (data.decoder=auto; decord {missing}: it has wheels for x86_64 Linux "
                    f"and Windows only)")


@functools.lru_cache(maxsize=None)
def reader(name: str):
    """The reader object of a resolved name (see resolve)."""
    return {"decord": DecordReader, "pyav": PyAVReader, "torchcodec": TorchcodecReader}[name]()


# -- decord ------------------------------------------------------------------------------------


class DecordReader:
    """decord 0.6, one decoding thread per reader (the data workers decode clips in parallel)."""

    name = "decord"

    def _open(self, path: str, **kw):
        _import_av_first()
        import decord  # deferred: optional reader (x86_64 wheels only), ~1 s to import

        try:
            return decord.VideoReader(path, ctx=decord.cpu(0), num_threads=1, **kw)
        except Exception as e:  # decord raises its own DECORDError / RuntimeError types
            raise VideoReadError(f"cannot open video {path}: {e}") from e

    def probe(self, path: str) -> VideoInfo:
        vr = self._open(path)
        n = len(vr)
        if n == 0:
            raise VideoReadError(f"video {path} has no frames")
        try:
            shape = vr[0].shape  # decodes one frame
        except Exception as e:
            raise VideoReadError(f"cannot decode the first frame of {path}: {e}") from e
        return VideoInfo(frames=n, height=int(shape[0]), width=int(shape[1]), fps=float(vr.get_avg_fps() or 0.0))

    def read(self, path: str, indices: list[int], info: VideoInfo) -> torch.Tensor:
        """uint8 [F, H, W, 3].

        decord 0.6 returns garbled frames (4 or 6 "channels") for some widths (e.g. 48, 72): the
        row stride of its output buffer is wrong. We then decode at the next width that is a
        multiple of 32, which it handles, and resize back to the native width (an approximation:
        the other readers return those frames exactly).
        """
        vr = self._open(path)
        try:
            arr = vr.get_batch(indices).asnumpy()
        except Exception:
            arr = None
        if arr is not None and arr.ndim == 4 and arr.shape[3] == 3 and arr.shape[1:3] != (info.height, info.width):
            # three clean channels at another size: the frames are fine and `info` is wrong (a damaged
            # shard index); resizing them to it would train on stretched frames without a word
            raise VideoReadError(f"{path} decodes to {arr.shape[2]}x{arr.shape[1]}, not the {info.width}x{info.height} "
                                 f"its record says")
        if arr is None or arr.shape[1:] != (info.height, info.width, 3):
            safe_w = int(math.ceil(info.width / 32) * 32)
            vr = self._open(path, width=safe_w, height=info.height)
            try:
                arr = vr.get_batch(indices).asnumpy()
            except Exception as e:
                raise VideoReadError(f"cannot decode frames of {path}: {e}") from e
            x = torch.from_numpy(np.ascontiguousarray(arr)).permute(0, 3, 1, 2).float()
            x = F.interpolate(x, size=(info.height, info.width), mode="bilinear", antialias=True, align_corners=False)
            return x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()
        return torch.from_numpy(np.ascontiguousarray(arr))


# -- PyAV --------------------------------------------------------------------------------------


def _upright(frame) -> np.ndarray:
    """RGB uint8 [H, W, 3] of a PyAV frame, turned by its display rotation as decord turns it
    (`frame.rotation` is counter-clockwise; decord's filter graph rotates 90/180/270 only)."""
    rgb = frame.to_ndarray(format="rgb24")
    clockwise = int(round(-float(getattr(frame, "rotation", 0) or 0))) % 360
    if clockwise in (90, 180, 270):
        rgb = np.rot90(rgb, k=-clockwise // 90)
    return rgb


class PyAVReader:
    """PyAV (FFmpeg's libraries bundled in its wheels): one decoding thread, as decord."""

    name = "pyav"

    @staticmethod
    def _open(path: str):
        import av  # deferred: PyAV loads FFmpeg (~1 s); only the PyAV reader needs it

        try:
            container = av.open(path)
        except Exception as e:  # av.FFmpegError (InvalidDataError, FileNotFoundError...), OSError
            raise VideoReadError(f"cannot open video {path}: {e}") from e
        if not container.streams.video:
            container.close()
            raise VideoReadError(f"cannot open video {path}: it has no video stream")
        stream = container.streams.video[0]
        stream.thread_count = 1
        return container, stream

    def probe(self, path: str) -> VideoInfo:
        """Counts the stream's packets (no decoding, as decord indexes them) and decodes the first frame."""
        container, stream = self._open(path)
        frames, first = 0, None
        rate = stream.average_rate  # read before the container closes (it frees the stream)
        try:
            with container:
                for packet in container.demux(stream):
                    if packet.size:  # the empty packet at the end only flushes the decoder
                        frames += 1
                    if first is None:
                        first = next(iter(packet.decode()), None)
        except Exception as e:
            raise VideoReadError(f"cannot decode the first frame of {path}: {e}") from e
        if frames == 0:
            raise VideoReadError(f"video {path} has no frames")
        if first is None:
            raise VideoReadError(f"cannot decode the first frame of {path}: no frame came out of {frames} packets")
        h, w = _upright(first).shape[:2]
        return VideoInfo(frames=frames, height=int(h), width=int(w), fps=float(rate) if rate else 0.0)

    def read(self, path: str, indices: list[int], info: VideoInfo) -> torch.Tensor:
        """uint8 [F, H, W, 3]: frames 0..max(indices) decoded in order, the wanted ones kept."""
        wanted = set(indices)
        last = max(indices)
        got: dict[int, np.ndarray] = {}
        container, stream = self._open(path)
        n = 0
        try:
            with container:
                for n, frame in enumerate(container.decode(stream), start=1):
                    if n - 1 in wanted:
                        got[n - 1] = _upright(frame)
                    if n > last:
                        break
        except Exception as e:
            raise VideoReadError(f"cannot decode frames of {path}: {e}") from e
        if len(got) < len(wanted):
            raise VideoReadError(f"cannot decode frames of {path}: frame {min(wanted - set(got))} was asked for but "
                                 f"the file decodes to {n} frames")
        return torch.from_numpy(np.stack([got[i] for i in indices]))


# -- torchcodec --------------------------------------------------------------------------------


class TorchcodecReader:
    """torchcodec's VideoDecoder in exact seek mode (a scan of the packets, frames by pts order,
    as decord), one FFmpeg thread, frames returned NHWC."""

    name = "torchcodec"

    @staticmethod
    def _open(path: str):
        from torchcodec.decoders import VideoDecoder  # deferred: optional reader (needs FFmpeg's shared libraries)

        try:
            return VideoDecoder(path, seek_mode="exact", dimension_order="NHWC", num_ffmpeg_threads=1, device="cpu")
        except Exception as e:  # RuntimeError / ValueError from its C++ core
            raise VideoReadError(f"cannot open video {path}: {e}") from e

    def probe(self, path: str) -> VideoInfo:
        dec = self._open(path)
        m = dec.metadata
        frames = int(m.num_frames or 0)
        if frames == 0:
            raise VideoReadError(f"video {path} has no frames")
        try:
            h, w = dec[0].shape[:2]  # decodes one frame, as the other readers do
        except Exception as e:
            raise VideoReadError(f"cannot decode the first frame of {path}: {e}") from e
        return VideoInfo(frames=frames, height=int(h), width=int(w), fps=float(m.average_fps or 0.0))

    def read(self, path: str, indices: list[int], info: VideoInfo) -> torch.Tensor:
        dec = self._open(path)
        try:
            return dec.get_frames_at(list(indices)).data.contiguous()
        except Exception as e:
            raise VideoReadError(f"cannot decode frames of {path}: {e}") from e
