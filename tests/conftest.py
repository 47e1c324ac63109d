"""Shared fixtures: config composition, a tiny training setup and the embedded data cache."""
from __future__ import annotations

import copy
import gc
import os
import sys
from pathlib import Path

import pytest

# Bytecode caches, also where PYTHONDONTWRITEBYTECODE is set (as in this project's containers):
# without them every pytest process (each xdist worker collects the whole suite) parsed, rewrote
# (pytest's assertion rewriting) and compiled every test module and dit_train module afresh, and
# every fresh Python a test starts (`run_cli`, the fork servers) compiled dit_train again: ~6 of a
# worker's ~15 CPU-s of start and collection (docs/suite-costs.md). The caches go to __pycache__
# (ignored by git); where that is not writable Python and pytest go on without them.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

from dit_train.config import Config
from dit_train.compose import compose

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
# The fresh Pythons the tests start (`python -m dit_train`, the tools, torch elastic's workers)
# import this checkout's dit_train, as pytest does: with the package installed editable from
# another checkout (a git worktree beside the main one), they imported that one's code instead.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

# A model and data small enough for many multi-process runs on 2 cores. init=normal so every
# parameter moves from step 1 (adaLN-zero would leave most weights untouched in 2 steps and
# make layout comparisons vacuous); SGD so the update is linear in the gradient.
TINY = [
    "model.dim=32", "model.depth=2", "model.heads=4", "model.init=normal",
    "optim=sgd", "optim.lr=0.5",
    "train.steps=2", "train.global_batch=6", "train.micro_batch_tokens=400", "train.progress=false",
    "train.sample_every=0",  # validation videos cost more than these runs; tests that need them turn them on
    "data.num_clips=16", "data.max_frames=8",
    # the generator's own sizes and 8x8 patches, not the quickstart's 32-wide clips and 4x4 patches:
    # widths 32-96 and 4-24 frames keep sample lengths very uneven (what the layouts must get right)
    "model.patch_size=[2,8,8]", "data.widths=[32,64,96]", "data.heights=[32,48,64]", "data.frames=[4,24]",
    "train.ema_decay=0",  # the quickstart's EMA is on; tests that cover EMA turn it on themselves
]
# TINY without the embedded set's data keys, for tests that switch to another data source
TINY_MODEL = [o for o in TINY if not o.startswith("data.")]


_COMPOSED: dict[tuple[str, ...], Config] = {}


def compose_config(overrides: list[str] | None = None, cache_dir: str | None = None) -> Config:
    """`compose(overrides)` (a copy of it: callers change their config freely). Hydra composes
    the same overrides once per session: a compose costs ~0.03 CPU-s (~0.25 the first time a set
    of config-group choices is composed: dit_train/compose.py), and tests ask for the same configs
    again and again (TINY, the presets, one base per file)."""
    key = tuple(overrides or [])
    if key not in _COMPOSED:
        _COMPOSED[key] = compose(list(key))
    cfg = copy.deepcopy(_COMPOSED[key])
    if cache_dir is not None:
        cfg.data.cache_dir = cache_dir
    return cfg


def needs(package: str) -> pytest.MarkDecorator:
    """Skip where `package` is not installed: found (importlib.util.find_spec), not imported, so that
    collecting a file imports no heavy library its tests import themselves (transformers ~1 CPU-s
    in every pytest process, xdist's workers each collect the whole suite)."""
    import importlib.util

    return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"{package} is not installed")


def refusal(overrides: list[str]) -> str:
    """check_config's refusal of `compose(overrides)`: the ConfigError's text, asserted one line."""
    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import check_config

    with pytest.raises(ConfigError) as info:
        check_config(compose_config(overrides))
    text = str(info.value)
    assert "\n" not in text, text
    return text


@pytest.fixture(scope="session", autouse=True)
def _worker_pools():
    """Multi-process tests run their jobs on reusable gloo workers (tests/pool.py) instead of
    spawning a new group each time; yields the real launcher for `real_launcher` tests."""
    import dit_train.engine.launch as launch
    from tests.pool import Pools

    pools, real = Pools(), launch.launch_local
    launch.launch_local = pools.launch_local
    yield real
    launch.launch_local = real
    pools.close()


@pytest.fixture(autouse=True)
def _real_launcher_when_marked(request, _worker_pools):
    """Tests of the launcher itself (failures, restarts) get torch elastic, not the pool."""
    if request.node.get_closest_marker("real_launcher") is None:
        yield
        return
    import dit_train.engine.launch as launch

    pooled, launch.launch_local = launch.launch_local, _worker_pools
    yield
    launch.launch_local = pooled


_FROZEN_FOR: list = [None]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Freeze the heap out of the collector's scans: at a new test module after a full
    collection, at every other test after a young one (what the last test imported joins).

    Python's full collections rescanned this process's whole heap (torch, diffusers,
    transformers, earlier modules' data) ~30 times a file: test_config + test_checkpoint +
    test_planner (not slow) spent 5.25 CPU-s of 49.7 in the collector, 3.09 with this
    (docs/suite-costs.md). The pool workers do the same per job (tests/pool.py). Unfreezing
    at each module lets a module's garbage cycles go at the next one: none outlives it by
    more than a module."""
    if item.module is not _FROZEN_FOR[0]:
        _FROZEN_FOR[0] = item.module
        gc.unfreeze()
        gc.collect()
    else:  # what the previous test imported (diffusers, transformers...) joins the frozen heap
        gc.collect(1)
    gc.freeze()


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    """One cache dir for the whole session (clips are generated once)."""
    return str(tmp_path_factory.mktemp("dit_train_cache"))


@pytest.fixture(scope="session")
def tiny_cfg(data_cache) -> Config:
    from dit_train.data_pipelines import prepare_data

    cfg = compose_config(TINY, cache_dir=data_cache)
    prepare_data(cfg.data, cfg.model)
    return cfg


def train_in_process(overrides: list[str], run_dir: Path, cache_dir: str | None = None) -> dict:
    """The CLI's path (check, prepare data, launch local workers if the layout needs them)
    without starting a new Python for rank 0; errors raise here. Returns rank 0's result."""
    from dit_train.__main__ import run_from_config

    cfg = compose_config(overrides, cache_dir=cache_dir)
    cfg.run_dir = str(run_dir)
    return run_from_config(cfg)


@pytest.fixture(scope="session")
def tiny_teacher(tiny_cfg, tmp_path_factory) -> Path:
    """A tiny trained bidirectional run (2 steps of TINY: its weights are not the init's), the
    teacher of the distillation tests (test_distill, test_self_forcing); read only."""
    run = tmp_path_factory.mktemp("teacher")
    train_in_process([*TINY, "train.steps=2"], run, cache_dir=tiny_cfg.data.cache_dir)
    return run


@pytest.fixture(scope="session")
def one_block_teacher(tiny_cfg, tmp_path_factory) -> Path:
    """tiny_teacher with one transformer block: the teacher of the distillation layout tests
    (test_distill, test_self_forcing), whose multi-process runs are Python-bound — each block is
    ~1/4 of a rank's CPU — and need no second block to split clips, counts and shards; read only."""
    run = tmp_path_factory.mktemp("one_block_teacher")
    train_in_process([*TINY, "model.depth=1", "train.steps=2"], run, cache_dir=tiny_cfg.data.cache_dir)
    return run


@pytest.fixture(scope="session")
def causal_run(tmp_path_factory, tiny_cfg) -> Path:
    """A tiny diffusion-forcing run (K = 4 frames, clips of up to data.max_frames = 8: 2 blocks) that
    test_streaming and test_drift stream from; read only."""
    from dit_train.engine.layout_equivalence import apply_layout
    from dit_train.engine.worker import train

    cfg = apply_layout(tiny_cfg, {})
    cfg.model.causal_block_frames = 4
    cfg.loss.frame_noise, cfg.loss.history_prob = "block", 0.5
    cfg.run_dir = str(tmp_path_factory.mktemp("causal_run"))
    train(cfg)
    return Path(cfg.run_dir)


def bidirectional_copy(run: Path, dest: Path) -> Path:
    """A copy of `causal_run` whose config says bidirectional (what the causal-only tools refuse)."""
    import shutil

    shutil.copytree(run, dest)
    text = (run / "config.yaml").read_text()
    (dest / "config.yaml").write_text(text.replace("  causal_block_frames: 4\n", "  causal_block_frames: 0\n", 1)
                                      .replace("  frame_noise: block\n", "  frame_noise: clip\n", 1)
                                      .replace("  history_prob: 0.5\n", "  history_prob: 0.0\n", 1))
    return dest


def run_cli(args: list[str], cwd: Path, timeout: int = 600, python: tuple[str, ...] = ()):
    """`python [python] -m dit_train <args>` in a subprocess; returns CompletedProcess (text)."""
    import subprocess

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, *python, "-m", "dit_train", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def pytest_addoption(parser):
    parser.addoption("--run-install", action="store_true",
                     help="run the tests marked `install` (they fetch from the package index; make test-install)")
    parser.addoption("--cpu-report", metavar="FILE", default=None,
                     help="write each test's CPU seconds (pytest's process + its pool workers and subprocesses), "
                          "sorted, and each file's total to FILE (tests/cpu_report.py); under -n N one FILE.gw<K> per worker")


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        # the pytest-xdist workers share the cores: torch's default (every core per process)
        # oversubscribes them, and OpenMP's spinning threads then burn CPU waiting for each other
        # (~12 % of an in-process test file's CPU at 2 workers on 2 cores). The fresh Pythons a test
        # starts inherit it (multi-process runs set their own threads per local worker).
        import torch

        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    path = config.getoption("--cpu-report")
    if path:
        if not os.path.isdir("/proc/self"):
            raise pytest.UsageError("--cpu-report reads /proc: Linux only")
        from tests.cpu_report import CpuReport

        worker = getattr(config, "workerinput", {}).get("workerid")
        if worker is None and getattr(config.option, "numprocesses", None):
            return  # pytest-xdist's controller runs no test: each worker writes FILE.gw<N>
        config.pluginmanager.register(CpuReport(f"{path}.{worker}" if worker else path), "cpu_report")


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection, which must see the measured `slow`
def pytest_collection_modifyitems(config, items):
    """Tests that measured tests.costs.SLOW_CPU_S or more are `slow` (`-m "not slow"` is the quick
    subset); under pytest-xdist the files come costliest first (tests/costs.py says why). `install`
    tests (wheel beside Hugging Face's kernels, dependency resolution per platform) fetch from the
    package index for ~1 min: only with --run-install (.ci/run runs them)."""
    from tests.costs import measured_slow, order_files_by_cost, read_table

    costs = read_table()
    for item in measured_slow(items, costs):
        item.add_marker(pytest.mark.slow)
    if hasattr(config, "workerinput"):  # every worker collects, and all must send the same order
        order_files_by_cost(items, costs)
    if config.getoption("--run-install"):
        return
    skip = pytest.mark.skip(reason="fetches from the package index: make test-install (pytest --run-install)")
    for item in items:
        if item.get_closest_marker("install"):
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` hands out files in the workers' collection order (heaviest first, above)
    instead of re-sorting them by their number of tests (xdist's default `--loadscope-reorder`,
    which put test_cli's 6 tests and 67 CPU-s near the end)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False
    return LoadFileScheduling(config, log)


class S3Endpoint:
    """A real S3 API on this machine (moto's server mode over HTTP), reached through s3fs exactly
    as a bucket is in production: `options` are the storage options a config passes."""

    BUCKET = "dit-train"

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.options = {"key": "testing", "secret": "testing",
                        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}

    def url(self, prefix: str) -> str:
        return f"s3://{self.BUCKET}/{prefix}"

    def overrides(self, prefix: str) -> list[str]:
        """data=shards at s3://<bucket>/<prefix>, with this endpoint's storage options."""
        return ["data=shards", f"data.url={self.url(prefix)}",
                "+data.storage_options={key: testing, secret: testing, client_kwargs: "
                f"{{endpoint_url: '{self.endpoint}', region_name: us-east-1}}}}"]

    def fs(self):
        import s3fs  # the shards extra; the fixture skips without it

        return s3fs.S3FileSystem(**self.options)


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1 (a free port) for the whole session, with one bucket."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    import logging

    import boto3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=S3Endpoint.BUCKET)
    yield S3Endpoint(endpoint)
    server.stop()


# -- the latent cache's tiny models and a one-process cache (tests/test_latent_cache.py, and the
# latent shard tests that must equal it): session fixtures, built once for both modules

Z_DIM, TEXT_DIM = 4, 16
LATENT_MEAN, LATENT_STD = [0.1, -0.2, 0.0, 0.3], [1.5, 0.5, 1.0, 2.0]


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Path:
    """A tiny random AutoencoderKLWan (vae/) and T5 encoder with a byte tokenizer (text/)."""
    pytest.importorskip("transformers")
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    d = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    AutoencoderKLWan(base_dim=8, z_dim=Z_DIM, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True],
                     latents_mean=LATENT_MEAN, latents_std=LATENT_STD).save_pretrained(d / "vae")
    ByT5Tokenizer().save_pretrained(d / "text")  # byte-level: needs no vocabulary file
    T5EncoderModel(T5Config(vocab_size=384, d_model=TEXT_DIM, d_kv=4, d_ff=32, num_layers=1, num_heads=2)).save_pretrained(d / "text")
    return d


@pytest.fixture(scope="session")
def source(tmp_path_factory) -> Path:
    """5 readable clips (4 captioned) + 1 corrupt file."""
    from tests.test_video_folder import make_video_folder

    return make_video_folder(tmp_path_factory.mktemp("videos"), tmp_path_factory.mktemp("src"), n=5)


def cache_args(models: Path, source: Path, out: Path, cache: Path, *extra: str) -> list[str]:
    return ["--vae", str(models / "vae"), "--text-encoder", str(models / "text"), "--out", str(out), "--no-progress",
            "data=video_folder", f"data.root={source}", f"data.cache_dir={cache}", "data.max_frames=5",
            "data.resolution_buckets=null", *extra]  # native sizes (the default is Wan's 480p): tiny latents


@pytest.fixture(scope="session")
def cache(models, source, tmp_path_factory) -> Path:
    """The clips of `source` encoded by one process (tests that change it put it back)."""
    from tools.cache_latents import main

    out = tmp_path_factory.mktemp("latents")
    assert main(cache_args(models, source, out, out.parent / "probe_cache")) == 0
    return out


CLIP_DIM, CLIP_TOKENS = 32, 17  # a 32-px image in 8-px patches: 16 + the class token


@pytest.fixture(scope="session")
def clip_dir(tmp_path_factory) -> Path:
    """A tiny random CLIPVisionModel + its image processor (nothing downloaded)."""
    pytest.importorskip("transformers")
    import torch
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    d = tmp_path_factory.mktemp("clip")
    torch.manual_seed(0)
    CLIPVisionModel(CLIPVisionConfig(hidden_size=CLIP_DIM, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
                                     image_size=32, patch_size=8)).save_pretrained(d / "image_encoder")
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(d / "image_processor")
    return d


@pytest.fixture(scope="session")
def i2v_cache(models, source, clip_dir, tmp_path_factory) -> Path:
    """The clips of `source` cached with Wan 2.1 I2V's tensors (--i2v first_frame, the tiny CLIP)."""
    from dit_train.tools.cache_latents import main

    out = tmp_path_factory.mktemp("i2v_latents")
    assert main(cache_args(models, source, out, out.parent / "probe_cache", "--i2v", "first_frame",
                           "--image-encoder", str(clip_dir))) == 0
    return out


# clips with a soft mask and a control video beside each, at sizes the tiny VAE encodes whole
# (multiples of 8 px; 5 or 9 frames = 2 or 3 latent frames); tests/test_cache_companions.py
COMPANION_SIZES = [(32, 32, 9), (32, 48, 5), (48, 32, 9), (16, 32, 5)]


@pytest.fixture(scope="session")
def companion_folder(tmp_path_factory) -> Path:
    from dit_train.data_pipelines.example_videos import ExampleClip, write_example_videos

    root = tmp_path_factory.mktemp("companion_videos")
    colors = ("red", "green", "blue", "yellow")
    write_example_videos(root, [ExampleClip(f"c{i}.mp4", h, w, 8, f, colors[i], ("circle", "square")[i % 2], "navy")
                                for i, (h, w, f) in enumerate(COMPANION_SIZES)], masks=True, control=True)
    return root


def companion_cache_args(models: Path, folder: Path, out: Path, *extra: str) -> list[str]:
    return ["--vae", str(models / "vae"), "--text-encoder", str(models / "text"), "--out", str(out), "--no-progress",
            "data=video_folder", f"data.root={folder}", f"data.cache_dir={out.parent / 'probe_cache'}",
            "data.max_frames=9", "data.resolution_buckets=null", "--masks", "--control", *extra]


@pytest.fixture(scope="session")
def companion_cache(models, companion_folder, tmp_path_factory) -> Path:
    """companion_folder cached with its masks and control videos (--masks --control)."""
    from dit_train.tools.cache_latents import main

    out = tmp_path_factory.mktemp("companion_latents")
    assert main(companion_cache_args(models, companion_folder, out)) == 0
    return out
