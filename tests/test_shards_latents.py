"""Latent shards: tools.cache_latents on 2 gloo ranks writing shards straight into the bucket
(restartable, index merged at the end), and make_shards from a latent cache; both read back
(and train) exactly like the latent cache folder. Tiny VAE / T5 and the one-process cache: tests/conftest.py."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("webdataset")  # dit_train.tools.make_shards imports it

from dit_train.compose import compose  # noqa: E402
from dit_train.data_pipelines import latent_cache as lc, source_for  # noqa: E402
from dit_train.engine import launch  # noqa: E402
from dit_train.tools.cache_latents import main as cache_latents  # noqa: E402
from dit_train.tools.make_shards import main as make_shards  # noqa: E402
from tests.conftest import TEXT_DIM, TINY_MODEL, Z_DIM, cache_args, needs, train_in_process  # noqa: E402

pytestmark = needs("transformers")

MODEL = [*TINY_MODEL, f"model.in_channels={Z_DIM}", f"model.text_dim={TEXT_DIM}", "model.patch_size=[1,2,2]"]


def _same_samples(shards_overrides: list[str], cache_dir) -> None:
    """data=shards gives the latent cache's samples: ids, lengths, latents, caption embeddings."""
    cfg = compose([*MODEL, *shards_overrides])
    src = source_for(cfg.data, cfg.model)
    assert src.latent and type(src).__name__ == "LatentShardsSource"
    shards, folder = src.open(), lc.LatentCacheDataset(cache_dir, (1, 2, 2))
    assert shards.lengths() == folder.lengths() and len(shards) == 5
    for i in range(len(folder)):
        a, b = folder[i], shards[i]
        assert a.caption == b.caption and torch.equal(a.pixels, b.pixels) and torch.equal(a.text_emb, b.text_emb), i
    assert torch.equal(shards.null_text_emb(), folder.null_text_emb())


@pytest.mark.slow
def test_two_ranks_encode_latent_shards_into_the_bucket(models, source, cache, s3_endpoint):
    """Each rank encodes its shards (k ≡ rank mod 2) on its device and uploads them; rank 0 merges
    the index; a restart re-encodes only the unfinished shard."""
    out = s3_endpoint.url("latents")
    argv = cache_args(models, source, out, cache.parent / "probe_cache", "--samples-per-shard", "2",
                      "--storage-options", json.dumps(s3_endpoint.options))
    assert launch.launch_local(cache_latents, (argv,), 2, None) == {0: 0, 1: 0}  # 2 local gloo processes
    fs = s3_endpoint.fs()
    report = json.loads(fs.cat_file(f"{out}/report.json"))
    assert (report["samples"], report["shards"], report["encoded"], report["reused"]) == (5, 3, 5, 0)
    _same_samples(s3_endpoint.overrides("latents"), cache)
    fs.rm(f"{out}/shard-000001.json")  # shard 1 (rank 1's) unfinished
    assert launch.launch_local(cache_latents, (argv,), 2, None) == {0: 0, 1: 0}
    report = json.loads(fs.cat_file(f"{out}/report.json"))
    assert (report["encoded"], report["reused"]) == (2, 3)
    _same_samples(s3_endpoint.overrides("latents"), cache)


def test_latent_cache_to_shards_trains_like_the_cache(cache, tmp_path):
    out = tmp_path / "latent_shards"
    assert make_shards(["--out", str(out), "--samples-per-shard", "2", "--no-progress", "data=latent_cache",
                        f"data.root={cache}"]) == 0
    _same_samples(["data=shards", f"data.url={out}"], cache)
    steps = [*MODEL, "train.steps=2", "train.global_batch=3", "train.save_weights=true"]
    train_in_process([*steps, "data=latent_cache", f"data.root={cache}"], tmp_path / "cache_run")
    train_in_process([*steps, "data=shards", f"data.url={out}"], tmp_path / "shards_run")
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "cache_run" / "weights.safetensors"), load_file(tmp_path / "shards_run" / "weights.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
