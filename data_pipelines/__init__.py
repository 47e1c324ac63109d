"""All data code: video reading and decoding (video_io.py, video_readers.py), clip sizes
(sizes.py), datasets of clips, folders and manifests (video_dataset.py, video_folder.py), the
embedded shapes world (synthetic_video.py, shapes_metric.py), latent caches (latent_cache.py), indexed tar shards on
any fsspec URL (shard_index.py, shard_store.py, shard_writer.py, shard_datasets.py),
text corpora (text.py), packing (packing.py), background decoding (prefetch.py) and bad records
(records.py); and the data sources that `data=<name>` picks, registered in `SOURCES` (the
protocol: source.py; each source: <name>_source.py).

`prepare_data` runs once before workers start (may write the embedded set or a probe index);
`open_dataset` runs in every worker and only reads. dit_train/tasks/ turns a dataset into what
the trainer consumes.
"""
from __future__ import annotations

from typing import Any

from dit_train.data_pipelines import (  # noqa: F401  (register)
    latent_cache_source, shards_source, synthetic_video_source, text_source, video_folder_source)
from dit_train.data_pipelines.prefetch import Prefetcher
from dit_train.data_pipelines.source import (SOURCES, DataSource, Dataset, data_location, register_source, run_source,
                                           source_for)


def prepare_data(data_cfg: Any, model_cfg: Any = None) -> None:
    """Create what must exist on disk before training (idempotent, safe to race)."""
    source_for(data_cfg, model_cfg).prepare()


def open_dataset(data_cfg: Any, model_cfg: Any, split: str = "train", companions: tuple[str, ...] = ()) -> Any:
    """The source's dataset of `split` (None if it has none), wrapped in background decoding
    when data.num_workers > 0; its samples carry the `companions` (mask, control) too."""
    ds = source_for(data_cfg, model_cfg, companions).open(split)
    if ds is not None and data_cfg.num_workers > 0 and split == "train":
        ds = Prefetcher(ds, data_cfg.num_workers)
    return ds


__all__ = ["SOURCES", "DataSource", "Dataset", "data_location", "open_dataset", "prepare_data", "register_source",
           "run_source", "source_for"]
