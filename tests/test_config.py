"""Config tree: every group option and experiment composes into the typed schema; typos fail."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from dit_train.config import Config
from dit_train.config.errors import ConfigError
from dit_train.engine.checks import check_config as validate
from tests.conftest import CONF, compose_config

GROUPS = ["model", "data", "parallel", "launcher", "loss", "cond", "optim", "train", "mode", "experiment"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_default_config_is_video_on_one_process():
    cfg = compose_config()
    assert isinstance(cfg, Config)
    assert cfg.mode == "video" and cfg.model.name == "dit" and cfg.data.name == "synthetic_video"
    assert cfg.loss.reduction == "sample_mean" and cfg.parallel.dp_shard == 1
    validate(cfg)


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes(group, option, tmp_path):
    prefix = "+" if group == "experiment" else ""
    extra = ["mode=llm"] if group == "model" and option.startswith("lm") else []
    if group == "model" and option.startswith("wan_i2v"):  # Wan 2.1 I2V: its conditioning and a latent cache
        extra = ["cond.kind=first_frame", "cond.feed=concat", "data=latent_cache", "data.root=latents/"]
    if group == "model" and option.startswith("wan_vace"):  # Wan VACE: a control video beside each clip
        extra = ["cond.control=true", "data=latent_cache", "data.root=latents/"]
    if group == "model" and option in ("skyreels_v2_1_3b", "skyreels_v2_14b"):  # causal blocks of 5 latent frames:
        extra = ["data=latent_cache", "data.root=latents/"]  # a latent cache (the embedded clips' 8 are off that grid)
    cfg = compose_config([*extra, f"{prefix}{group}={option}"])
    assert isinstance(cfg, Config)
    if group in ("model", "data", "experiment"):  # every schema, and the values experiments set
        from dit_train.config import to_yaml

        assert to_yaml(cfg) == OmegaConf.to_yaml(OmegaConf.structured(cfg))
    if getattr(cfg.model, "sync_encoder", "") and not Path(cfg.model.sync_encoder).exists():
        from tests.test_av_sync import random_encoder  # the file its user trains first (tools.train_sync)

        cfg.model.sync_encoder = random_encoder(tmp_path)
    if group not in ("data",):  # data options may need a user path (data.root=???)
        validate(cfg)


def test_stable_user_keys_exist():
    cfg = compose_config([
        "train.steps=7", "train.seed=3", "train.global_batch=5", "train.grad_accum=2", "train.micro_batch_tokens=999",
        "optim.name=sgd", "optim.lr=0.1", "optim.weight_decay=0.01", "optim.max_grad_norm=0", "loss.reduction=token_mean",
        "parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.cp_ulysses=2", "parallel.cp_ring=2",
        "parallel.dp_mode=ddp", "parallel.cp_fsdp_mode=none",
    ])
    assert (cfg.train.steps, cfg.train.seed, cfg.train.global_batch, cfg.train.grad_accum) == (7, 3, 5, 2)
    assert cfg.optim.max_grad_norm == 0 and cfg.parallel.cp_fsdp_mode == "none"


@pytest.mark.parametrize("override", ["train.stpes=3", "optim.lr=fast", "parallel.dp_shards=2", "model=dit_huge"])
def test_typos_fail_at_composition(override):
    with pytest.raises(ConfigCompositionException):
        compose_config([override])


def test_mode_llm_switches_model_data_and_reduction():
    cfg = compose_config(["mode=llm"])
    assert (cfg.mode, cfg.model.name, cfg.data.name, cfg.loss.reduction) == ("llm", "lm", "text", "token_mean")
    cfg = compose_config(["mode=llm", "loss=sample_mean"])  # a user's choice still wins
    assert cfg.loss.reduction == "sample_mean"


def test_experiment_video_cp8_is_8_way_cp():
    cfg = compose_config(["+experiment=video_cp8"])
    assert cfg.parallel.cp_ulysses * cfg.parallel.cp_ring == 8
    validate(cfg)


@pytest.mark.parametrize("override,needle", [
    (["parallel.cp_ulysses=3"], "divisible by parallel.cp_ulysses"),
    (["parallel.dp_mode=ddp", "parallel.meta_init=true"], "meta_init"),
    # one process is not wrapped in FSDP2: the meta-device build would crash in parallelize
    (["parallel.meta_init=true"], "parallel.meta_init=true needs FSDP2 over >= 2 ranks"),
    (["mode=llm", "model=dit_tiny"], "cannot train model=dit"),
    (["mode=llm", "data=synthetic_video"], "data=synthetic_video is a source for mode=video"),
    (["model.pooled_text=true", "model.text_dim=0"], "model.pooled_text=true pools the caption: set model.text_dim > 0"),
    (["model.causal_block_frames=3"], r"model.causal_block_frames=3 must be 0 \(bidirectional\) or a positive multiple"),
    (["cond.given_stream=video"], "built for the two-stream DiT .* not model=dit without an audio stream"),
    (["model.audio_patch=300", "model.audio_features=spectrogram"], "a positive multiple of the STFT hop 125"),
    (["model=ltx2_tiny", "data.audio=true", "cond.given_stream=audio"], "not model=ltx2"),
])
def test_invalid_values_give_actionable_errors(override, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(compose_config(override))


@pytest.mark.parametrize("override", ["train.precision=fp8", "loss.reduction=mean", "parallel.dp_mode=zero3",
                                      "optim.name=lion", "model.attn_backend=magic", "cond.given_stream=both",
                                      "model.audio_features=mel"])
def test_enumerated_keys_are_checked_by_the_schema(override):
    """Allowed values live once, in the schema's Choice enums: composition rejects others..."""
    with pytest.raises(ConfigCompositionException, match=override.split("=")[0]):
        compose_config([override])


def test_enumerated_keys_of_configs_built_in_python_are_checked_too():
    """... and configs made in Python (no Hydra) are checked against the same enums."""
    cfg = compose_config()
    cfg.train.precision, cfg.parallel.dp_mode, cfg.cond.given_stream = "fp8", "zero3", "both"
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert "cond.given_stream='both' must be one of none, video, audio" in str(err.value)
    assert "train.precision='fp8' must be one of fp32, bf16, fp16" in str(err.value)
    assert "parallel.dp_mode='zero3' must be one of fsdp2, ddp, none" in str(err.value)


def test_compose_equals_hydras_whole_compose():
    """dit_train.compose reuses Hydra's tree per config-group choice and applies the key=value
    overrides to a copy: each result (or refusal) is what one whole Hydra compose gives, also
    right after a compose that set, added or deleted keys of the same tree."""
    from dit_train.compose import compose as ours
    from dit_train.compose import register_configs
    from dit_train.config import to_config, to_yaml

    def outcome(make, overrides):
        try:
            return to_yaml(make(overrides))
        except (ConfigCompositionException, ConfigError) as err:
            return f"{type(err).__name__}: {err}"

    def whole(overrides):
        register_configs()
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return to_config(compose("config", overrides=overrides))

    for overrides in (["optim.lr=0.1", "optim=sgd", "train.steps=3", "++model.dim=16"], ["optim=sgd"],
                      ["mode=llm", "train.steps=2"], ["+experiment=wan_lora", "model.lora.rank=2"],
                      ["+model.foo=1"], ["~train.loggers"], ["train.steps=1", "+train.steps=2"]):
        assert outcome(ours, overrides) == outcome(whole, overrides), overrides


def test_to_yaml_follows_every_change_of_the_config():
    """to_yaml keeps the YAML per config value (its repr): a config changed in place, or a node of
    it, is written as OmegaConf writes it now, never an earlier text."""
    from dit_train.config import to_yaml

    cfg = compose_config()
    assert to_yaml(cfg) == OmegaConf.to_yaml(OmegaConf.structured(cfg))
    cfg.train.steps, cfg.model.patch_size[0] = 12345, 3
    assert to_yaml(cfg) == OmegaConf.to_yaml(OmegaConf.structured(cfg)) and "steps: 12345" in to_yaml(cfg)
    assert to_yaml(cfg.model) == OmegaConf.to_yaml(OmegaConf.structured(cfg.model))
    # what a config built in Python may hold, and OmegaConf's copy converts: an int in a float
    # field (3.0), a tuple (a list), an enum by its value (its name), a str in an int field ('5' -> 5)
    cfg.optim.lr, cfg.model.patch_size, cfg.parallel.dp_mode = 1, (1, 2, 2), "ddp"
    assert to_yaml(cfg) == OmegaConf.to_yaml(OmegaConf.structured(cfg)) and "lr: 1.0" in to_yaml(cfg)
    cfg.train.steps = "5"
    assert to_yaml(cfg) == OmegaConf.to_yaml(OmegaConf.structured(cfg)) and "steps: 5\n" in to_yaml(cfg)


def test_world_size_mismatch_under_torchrun_says_what_to_change():
    with pytest.raises(ConfigError, match="parallel.dp_shard=4"):
        validate(compose_config(["parallel.dp_shard=2"]), world_size=4)


def test_slurm_launcher_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from dit_train.compose import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        d = compose("config", overrides=["hydra/launcher=submitit_slurm", "hydra.launcher.nodes=2",
                                         "hydra.launcher.tasks_per_node=8", "hydra.launcher.gpus_per_node=8",
                                         "parallel.dp_shard=16"], return_hydra_config=True)
    assert d.hydra.launcher.nodes == 2 and d.hydra.launcher.tasks_per_node == 8
    assert "SlurmLauncher" in d.hydra.launcher._target_


def test_slurm_task_environment_becomes_torch_ranks(monkeypatch):
    pytest.importorskip("submitit")
    from dit_train.engine.launch import adopt_slurm_env, external_world_size

    import os

    # adopt_slurm_env writes os.environ: give it a throw-away copy so nothing leaks into later tests
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")})
    env = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
           "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_NODEID": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert external_world_size() == 8
    assert adopt_slurm_env()
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == ("5", "1", "8")
    assert os.environ["MASTER_ADDR"] == "node07"


def _documented_defaults(page: Path) -> list[tuple[str, str]]:
    """(key, default cell) of every `| `a.b` | default | ... |` row of a docs table."""
    import re

    rows = []
    for line in page.read_text().splitlines():
        m = re.match(r"\| `([a-z_]+\.[a-z_.]+)` \| ([^|]+) \|", line)
        if m:
            rows.append((m.group(1), m.group(2).strip()))
    return rows


def _parse_cell(cell: str):
    import re

    import yaml

    cell = re.sub(r"\s*\(.*\)$", "", cell).strip().strip("`")  # "3 (schema default 2)" -> 3
    try:
        return float(cell) if re.fullmatch(r"-?[0-9.]+e-?[0-9]+", cell) else yaml.safe_load(cell)
    except yaml.YAMLError:
        return None


def test_every_key_has_a_row_in_a_docs_table():
    """Each key of the default config (and of the LLM's) is a row of a table in the README or
    docs/ (launcher.heartbeat_timeout_s had none)."""
    from dit_train.compose import compose as compose_dit
    from dit_train.engine.resume import flatten

    pages = [CONF.parent / "README.md", *sorted((CONF.parent / "docs").glob("*.md"))]
    rows = "".join(p.read_text() for p in pages)
    keys = {**flatten(compose_dit([])), **flatten(compose_dit(["mode=llm"]))}
    missing = [k for k in keys if f"| `{k}` |" not in rows]
    assert len(keys) > 100 and not missing, missing


@pytest.mark.parametrize("page", ["docs/configuration.md", "README.md"])
def test_documented_defaults_are_the_configs(page):
    """The defaults tables say what `python -m dit_train` runs with: a default changed in conf/
    without its row (or the reverse) fails here. Rows of keys the default config does not have
    (Wan, LLM, per-source keys) and free-text cells are not checked."""
    from dit_train.compose import compose as compose_dit
    from dit_train.config import to_dict

    cfg, wrong, checked = to_dict(compose_dit([])), [], 0
    for key, cell in _documented_defaults(CONF.parent / page):
        same = _same_default(cfg, key, cell)
        checked += same is not None
        if same is False:
            wrong.append(f"{key}: {page} says {cell}, the config has {_value_of(cfg, key)!r}")
    assert checked > 10, f"parsed only {checked} rows of {page}"
    assert not wrong, "\n".join(wrong)


def _value_of(cfg: dict, key: str):
    node = cfg
    for part in key.split("."):
        node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
    return node


def _same_default(cfg: dict, key: str, cell: str) -> bool | None:
    """Whether the documented `cell` is `key`'s value in `cfg`; None when the key is not in
    `cfg` or the cell is prose (string defaults are `quoted`)."""
    node, want = _value_of(cfg, key), _parse_cell(cell)
    if node is KeyError or want is None or (isinstance(want, str) and not (isinstance(node, str) and cell.startswith("`"))):
        return None
    return float(want) == float(node) if isinstance(want, (int, float)) and isinstance(node, (int, float)) else want == node


def test_documented_per_source_defaults_are_the_sources_configs():
    """configuration.md's per-source rows (`| key | source | default | ... |`) say what
    `data=<source>` runs with (they are not in the default config the test above checks)."""
    import re

    from dit_train.compose import compose as compose_dit
    from dit_train.config import to_dict

    page, cfgs, wrong, checked = CONF.parent / "docs" / "configuration.md", {}, [], set()
    for line in page.read_text().splitlines():
        m = re.match(r"\| `([a-z_]+\.[a-z_.]+)` \| `([a-z_]+)` \| ([^|]+) \|", line)
        if not m or not (CONF / "data" / f"{m.group(2)}.yaml").is_file():
            continue
        key, source, cell = m.group(1), m.group(2), m.group(3).strip()
        if source not in cfgs:  # data=text is the LLM mode's source
            cfgs[source] = to_dict(compose_dit(["mode=llm"] if source == "text" else [f"data={source}"]))
        same = _same_default(cfgs[source], key, cell)
        if same is not None:
            checked.add(source)
        if same is False:
            wrong.append(f"{key} ({source}): configuration.md says {cell}, data={source} has "
                         f"{_value_of(cfgs[source], key)!r}")
    assert checked >= {"synthetic_video", "video_folder", "latent_cache", "shards", "text"}, checked
    assert not wrong, "\n".join(wrong)
