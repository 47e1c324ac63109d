"""Process groups and the device mesh for dp_replicate × dp_shard × cp_ring × cp_ulysses."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dit_train.config import PARALLEL_DEGREES, ParallelConfig

# Mesh dimension order, outermost first (see PARALLEL_DEGREES for why).
MESH_DIMS = PARALLEL_DEGREES


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees (fields in PARALLEL_DEGREES order)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp_ring: int = 1
    cp_ulysses: int = 1

    @staticmethod
    def from_config(cfg: ParallelConfig) -> "ParallelDims":
        return ParallelDims(**{k: getattr(cfg, k) for k in PARALLEL_DEGREES})

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def cp(self) -> int:
        return self.cp_ring * self.cp_ulysses

    @property
    def world(self) -> int:
        return self.dp * self.cp

    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, k) for k in PARALLEL_DEGREES)

    def describe(self) -> str:
        return " x ".join(f"{k}={getattr(self, k)}" for k in PARALLEL_DEGREES) + f" = {self.world}"


@dataclass
class ParallelContext:
    """Everything a rank needs to know about the layout.

    cp_rank is the flattened index r·cp_ulysses + u (ring-major), which is also the index of
    the pack chunk this rank holds. Groups are None where their size is 1 (no collective).
    """

    dims: ParallelDims
    device: torch.device
    rank: int = 0
    local_rank: int = 0
    mesh: DeviceMesh | None = None
    views: dict[str, DeviceMesh] = field(default_factory=dict)
    dp_rank: int = 0
    cp_rank: int = 0
    ring_rank: int = 0
    ulysses_rank: int = 0
    dp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    ring_group: dist.ProcessGroup | None = None
    ulysses_group: dist.ProcessGroup | None = None
    world_group: dist.ProcessGroup | None = None
    # expert parallelism (parallel.ep): ep consecutive ranks share the experts of a MoE layer;
    # the replica group joins the ranks holding the same experts (dit_train/parallel/expert_parallel.py)
    ep: int = 1
    ep_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    ep_replica_group: dist.ProcessGroup | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.mesh is not None


def resolve_device(cfg: ParallelConfig, local_rank: int = 0) -> torch.device:
    if cfg.device == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    elif cfg.device in ("cpu", "cuda"):
        kind = cfg.device
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError("parallel.device=cuda but no CUDA device is visible; use parallel.device=cpu")
    else:
        raise ValueError(f"parallel.device={cfg.device!r} must be auto, cpu or cuda")
    if kind == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _restart_safe_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torch elastic the workers share the agent's TCPStore, which outlives a restart:
    the killed round's keys (e.g. gloo's peer addresses) would be read back by the new round
    and connections refused. A prefix per restart round keeps each round's keys apart."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"dit_train/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_parallel(cfg: ParallelConfig) -> ParallelContext:
    """Initialise the process group (if the layout needs more than one process) and the mesh.

    Reads the rank from the launcher's standard variables (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR/PORT) set by our local launcher, torchrun or the SLURM adapter. One process
    runs a plain model unless its caller already started a process group of one: then it
    gets the mesh too, so FSDP2 wraps the model (the GPU check runs FSDP2 on NCCL that way).
    """
    dims = ParallelDims.from_config(cfg)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(cfg, local_rank)
    if dims.world == 1 and not (dist.is_initialized() and dist.get_world_size() == 1):
        return ParallelContext(dims=dims, device=device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=cfg.timeout_s)
        store = _restart_safe_store(timeout)
        if store is not None:
            dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
    if dist.get_world_size() != dims.world:
        raise ValueError(f"{dist.get_world_size()} processes were started but the layout needs "
                         f"{dims.describe()}; start that many or change the parallel.* degrees")
    mesh = init_device_mesh(device.type, dims.shape(), mesh_dim_names=MESH_DIMS)
    # Flattened views are kept by name: slicing them back out of the root mesh is deprecated.
    views = {
        "dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
        "cp": mesh["cp_ring", "cp_ulysses"]._flatten("cp"),
        "dp_cp": mesh["dp_replicate", "dp_shard", "cp_ring", "cp_ulysses"]._flatten("dp_cp"),
        "cp_ring": mesh["cp_ring"],
        "cp_ulysses": mesh["cp_ulysses"],
    }

    def group(name: str, size: int) -> dist.ProcessGroup | None:
        return views[name].get_group() if size > 1 else None

    ep = cfg.ep
    if dims.world % ep:
        raise ValueError(f"parallel.ep={ep} must divide the world size {dims.describe()}")
    if ep > 1:  # world ranks in order, regrouped as (replicas, ep): EP groups are consecutive ranks
        ep_mesh = views["dp_cp"]._unflatten(0, (dims.world // ep, ep), ("ep_replica", "ep"))
        views["ep"], views["ep_replica"] = ep_mesh["ep"], ep_mesh["ep_replica"]

    return ParallelContext(
        ep=ep, ep_rank=views["ep"].get_local_rank() if ep > 1 else 0,
        ep_group=group("ep", ep), ep_replica_group=group("ep_replica", dims.world // ep) if ep > 1 else None,
        dims=dims, device=device, rank=dist.get_rank(), local_rank=local_rank, mesh=mesh, views=views,
        dp_rank=views["dp"].get_local_rank(), cp_rank=views["cp"].get_local_rank(),
        ring_rank=views["cp_ring"].get_local_rank(), ulysses_rank=views["cp_ulysses"].get_local_rank(),
        dp_group=group("dp", dims.dp), cp_group=group("cp", dims.cp),
        ring_group=group("cp_ring", dims.cp_ring), ulysses_group=group("cp_ulysses", dims.cp_ulysses),
        world_group=views["dp_cp"].get_group(),
    )


def fsdp_mesh(ctx: ParallelContext, cp_fsdp_mode: str) -> DeviceMesh:
    """The mesh FSDP2 shards over: 2-D (replicate, shard) for HSDP when dp_replicate > 1.

    cp_fsdp_mode=all: shard over dp_shard × cp (CP ranks hold different tokens of the same
    samples, so their gradients are summed by the same reduce-scatter). none: shard over
    dp_shard only; the CP sum is a separate all-reduce.
    """
    assert ctx.mesh is not None
    d = ctx.dims
    if cp_fsdp_mode == "all":
        base, shard = ctx.views["dp_cp"], d.dp_shard * d.cp
    else:
        base, shard = ctx.views["dp"], d.dp_shard
    if d.dp_replicate == 1:
        return base
    return base._unflatten(0, (d.dp_replicate, shard), ("dp_replicate", "dp_shard_fsdp"))


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
