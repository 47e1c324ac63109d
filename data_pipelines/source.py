"""What a data source is: the protocol every registered source follows.

A source is one module (`data_pipelines/<name>_source.py`: its config node and a `DataSource`
subclass registered in `SOURCES`) plus one YAML (`conf/data/<name>.yaml`, whose defaults list
names `<name>_schema`). The trainer never sees a source: `build_task` wraps the dataset it
opens into the mode's task (video: noisy packed patches; llm: packed documents), which is what
the step planner and the trainer use (`lengths()`, `build(ids, step)`, optional `prefetch`).
What differs between sources is asked through the hooks of `DataSource`, never by its name.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Protocol, runtime_checkable

import torch

from dit_train.config.choices import Mode
from dit_train.data_pipelines.prompt_space import PromptSpace
from dit_train.registry import Registry


@runtime_checkable
class Dataset(Protocol):
    """Samples by id (0..len-1) with token counts known without decoding.

    `__getitem__` returns a `VideoSample` (video: pixels [C, F, H, W] or latents, caption,
    optional text_emb) or a `Document` (llm: ids [T], prompt_len); it may raise
    `VideoReadError` for a sample that cannot be read (the task skips and counts it).
    `skipped`: (file, why) of what was left out while the dataset was built.
    Optional: `prefetch(ids)` to decode ahead in background workers.
    """

    skipped: list

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> Any: ...

    def lengths(self) -> list[int]: ...


def data_location(data_cfg: Any) -> str:
    """The configured data in a few words for a message: the key naming where its samples come
    from with its value (`data.root=...`, `data.url=...`, `data.text_path=...`), or `data=<name>`."""
    for key in ("root", "url", "text_path"):
        if getattr(data_cfg, key, ""):
            return f"data.{key}={getattr(data_cfg, key)}"
    return f"data={data_cfg.name}"


class DataSource:
    """A registered source of samples for one mode.

    prepare(): runs once, before any worker starts (may write to disk: the embedded clips, a
    probe index); must be idempotent and safe to race. open(split): runs in every worker and
    only reads; returns the split's Dataset, or None when the source has no such split.
    Errors a user can fix are ValueErrors naming the key or file to change.
    """

    name: ClassVar[str]
    config: ClassVar[type]
    mode: ClassVar[Mode]
    latent: ClassVar[bool] = False  # samples are VAE latents, not pixels (decoder() turns clips into pixels)
    # files read with each clip that this source can give ("mask", "control": data_pipelines/companions.py)
    companion_kinds: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: Any, model_cfg: Any, companions: tuple[str, ...] = ()):
        """companions: the companion kinds the run needs (config.schema.companions); each one of
        companion_kinds, which check_config makes sure of."""
        self.cfg, self.model_cfg, self.companions = cfg, model_cfg, tuple(companions)

    @classmethod
    def may_be_latent(cls) -> bool:
        """Whether this source's data can be VAE latents (checked before any file is read): its
        `latent`, or True for a source whose kind follows its data (shards)."""
        return cls.latent

    @classmethod
    def for_config(cls, cfg: Any, model_cfg: Any, companions: tuple[str, ...] = ()) -> "DataSource":
        """The source object of `cfg`: this class by default; a source whose behaviour follows its
        data (shards holding pixels or latents, data_pipelines/shards_source.py) returns the class
        that fits what it finds."""
        return cls(cfg, model_cfg, companions)

    @classmethod
    def for_run(cls, cfg: Any, model_cfg: Any, record: dict) -> "DataSource":
        """The source of a trained run, for sampling it: `record` is what the run's folder kept of
        this source when the run was claimed (its `run_record()`, run.json's "data"), so that a
        source which learns what it is from its data (shards) needs no data to sample prompts;
        {} for a run folder without one. By default `for_config`."""
        return cls.for_config(cfg, model_cfg)

    def run_record(self) -> dict:
        """What sampling a run needs from this source beyond its config, kept in the run folder
        when the run is claimed (JSON; given back to `for_run`): {} by default."""
        return {}

    def prepare(self) -> None:
        """Nothing to do by default."""

    def open(self, split: str = "train") -> Dataset | None:
        raise NotImplementedError

    def decoder(self, device: str | torch.device) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Model-space clip [C, f, h, w] -> pixels [3, F, H, W] in [-1, 1], to view and score
        generated clips (built on the rank that writes them); None when samples are pixels."""
        return None

    def sound(self, device: str | torch.device) -> Any:
        """How generated audio tokens become sound when they are not waveform samples (a cache's
        LTX-2 audio latents: audio_latents.LatentSound: `tokens(shape)`, `waveform(tokens)`); None:
        the tokens are 16 kHz samples (sampling/sound.py)."""
        return None

    def prompt_space(self, device: str | torch.device) -> PromptSpace | None:
        """How a user's prompts and clip sizes map into model space when the source knows better
        than its task (a latent cache: its text encoder and VAE); None = the task's own space
        (pixels, captions as the task embeds them: sampling/prompts.py)."""
        return None

    def score(self, pixels: list, captions: list[str]) -> dict[str, float] | None:
        """Quality figures (`eval/...`) of generated clips [3, F, H, W] in [-1, 1] against their
        captions, for sources whose world can be scored exactly; None otherwise."""
        return None

    def sync_events(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Clips [3, F, H, W] in [-1, 1] of compositions the training data never shows, each with
        [F] 1 on the frames where a sound event must start, for sources whose world knows them
        (tools.train_sync scores its encoder on them); None otherwise."""
        return None

    def is_still(self, dataset: Any, i: int) -> bool:
        """Whether sample i is a still image (a one-frame sample)."""
        return False

    def fps(self, dataset: Any, i: int) -> float:
        """Frame rate of sample i as the model sees it (for writing generated videos)."""
        return 8.0

    def describe(self, dataset: Any, i: int) -> str:
        """Sample i in a few words for an error message (its file, its size); "" if nothing to say."""
        return ""

    def fitting_keys(self, dataset: Any, budget: int) -> list[str]:
        """Overrides of this source's keys (`data.max_frames=8`) with which every sample of
        `dataset` has at most `budget` tokens (what the "sample too long" error suggests)."""
        return []


SOURCES: Registry[type[DataSource]] = Registry("data source")


def register_source(cls: type[DataSource]) -> type[DataSource]:
    """Class decorator: add a DataSource subclass to SOURCES under its `name`."""
    SOURCES.register(cls.name, cls)
    return cls


def source_for(cfg: Any, model_cfg: Any, companions: tuple[str, ...] = ()) -> DataSource:
    return SOURCES[cfg.name].for_config(cfg, model_cfg, companions)


def run_source(cfg: Any, model_cfg: Any, record: dict) -> DataSource:
    """The source of a trained run as its folder recorded it (`DataSource.for_run`)."""
    return SOURCES[cfg.name].for_run(cfg, model_cfg, record)
