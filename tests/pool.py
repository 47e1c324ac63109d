"""Reusable local gloo workers for the test suite.

Spawning workers (a Python per rank importing torch and dit_train) costs more than the tiny
runs the multi-process tests do, and the suite launches dozens of them. `WorkerPool` keeps one
group of `world` processes with an initialised gloo process group alive for the session and
runs each job `fn(*args)` on all of them, exactly like `dit_train.engine.launch.launch_local`
(same environment variables, same return value {rank: result}). Jobs make their own device
meshes (subgroups of the same world; a worker hands jobs of the same layout the same mesh), so
layouts of one world size run in the same pool.

Workers are forked from a fork server that has imported torch and dit_train (PRELOAD), not
spawned as fresh Pythons that each import them again.

A job that raises on any rank fails the call with that rank's traceback, and the pool is
replaced (a rank may be stuck in a collective its peers never entered; the short collective
timeout frees it). Tests of the launcher itself (failures, restarts, hangs) use the real one:
mark them `@pytest.mark.real_launcher`.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import traceback
from typing import Any, Callable

JOB_TIMEOUT_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_the_fork_server() -> None:
    """SIGKILL this worker when its parent, the fork server, ends — and the fork server ends with
    the suite's process. A worker stopped between jobs (WorkerPool.pause) cannot notice by itself
    that the suite is gone (killed, timed out), and SIGTERM waits until a stopped process runs
    again; SIGKILL does not."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _serve(rank: int, world: int, port: int, jobs: Any, results: Any) -> None:
    _die_with_the_fork_server()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    # collectives of a job some rank left early time out instead of blocking the pool forever
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    _reuse_device_meshes()
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args = job[0], _unpack(job[1])
        # Python's collector rescanned the workers' large heaps (torch, transformers) during jobs:
        # ~13% of a worker's samples under perf in the post-training layout test, ~5% like this.
        # Jobs are short: the previous jobs' garbage is collected here, what survives is frozen
        # out of later scans, and the collector is off while the job runs.
        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            results.put((rank, True, _pack(fn(*args))))
        except BaseException:  # noqa: BLE001 - reported to the test, which fails
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


def _reuse_device_meshes() -> None:
    """Jobs of the same layout get the same DeviceMesh (and so the same process groups).

    Each job builds its meshes anew, and every gloo group keeps a `gloo_tcp_loop` thread that
    wakes ~100 times a second even when idle. Without reuse they piled up in the workers: after
    a few hundred jobs ~350 such threads made ~35k context switches a second and the suite spent
    a third of its CPU time in the kernel. Destroying a job's groups instead is not safe: DTensor
    caches plans keyed by meshes that compare equal by layout, and would hand a later job an
    earlier job's destroyed group. Flattened views come from the root mesh's own `_flatten`
    cache; `_unflatten` (HSDP's and EP's meshes) has none, so it is cached here as well. Both are
    called with hashable arguments (tuples, names, a mesh); a list would fail the job loudly."""
    import functools

    import torch.distributed.device_mesh as device_mesh

    import dit_train.parallel.mesh as mesh_module

    device_mesh.init_device_mesh = mesh_module.init_device_mesh = functools.cache(device_mesh.init_device_mesh)
    device_mesh.DeviceMesh._unflatten = functools.cache(device_mesh.DeviceMesh._unflatten)
    _share_groups_of_the_same_ranks(device_mesh)


def _share_groups_of_the_same_ranks(device_mesh: Any) -> None:
    """Meshes get one process group per set of ranks: a mesh asks `new_group` for every
    subgroup of every dimension, flattened views included, so meshes of different layouts
    created the same rank sets again and again — after the layout tests a worker of the 4-worker
    pool held ~140 gloo groups (and their threads: 0.13 CPU-s every second for the pool while it
    waited for nothing). A group serves any number of meshes: every rank of it issues their
    collectives in the same program order, and gloo tells concurrent collectives of one group
    apart by their sequence numbers. `new_group` is collective (every rank calls it for every
    subgroup, member or not), and every rank asks for the same rank sets in the same order, so
    every rank reuses the same groups."""
    import inspect

    import torch.distributed.distributed_c10d as c10d

    create, groups = c10d.new_group, {}
    signature = inspect.signature(create)

    def new_group(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = dict(bound.arguments)
        if a["pg_options"] is not None or a["ranks"] is None:
            return create(*args, **kwargs)
        ranks = sorted(a["ranks"]) if a["sort_ranks"] else list(a["ranks"])
        key = (tuple(ranks), a["timeout"], a["backend"], a["use_local_synchronization"], a["device_id"])
        if key not in groups:
            groups[key] = create(*args, **kwargs)
        return groups[key]

    device_mesh.new_group = c10d.new_group = new_group


class _Array:
    """A CPU tensor of a job's result on its way back, as a numpy array: the results queue pickles
    a torch tensor through torch.multiprocessing's shared-memory reduction (a segment and a file
    descriptor per tensor), ~0.5 ms each — a layout run returns ~250 of them (initial, final and
    EMA weights); an array costs ~0.02 ms."""

    __slots__ = ("array",)

    def __init__(self, array: Any):
        self.array = array


def _pack(obj: Any) -> Any:
    """`obj` with the plain CPU tensors in its dicts, lists and tuples as `_Array`s (tensors numpy
    cannot hold — bfloat16, requiring grad, subclasses — travel as they are)."""
    import torch

    if type(obj) is torch.Tensor and obj.device.type == "cpu" and not obj.requires_grad:
        try:
            return _Array(obj.numpy())
        except (TypeError, RuntimeError):  # a dtype numpy lacks, a conjugate view
            return obj
    if type(obj) is dict:
        return {k: _pack(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_pack(v) for v in obj)
    return obj


def _unpack(obj: Any) -> Any:
    import torch

    if type(obj) is _Array:
        return torch.from_numpy(obj.array)
    if type(obj) is dict:
        return {k: _unpack(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_unpack(v) for v in obj)
    return obj


class WorkerFailed(RuntimeError):
    """A job raised on some rank (the message holds its traceback)."""


# What the jobs import: the fork server (below) imports it once, and each worker starts as a
# fork of that server with it already loaded. dit_train first: it sets GOMP_SPINCOUNT before
# torch loads libgomp. peft (~2 CPU-s with transformers): the suite's LoRA layouts run on every
# worker of the 2- and 4-worker pools. The video readers (PyAV before decord, as
# data_pipelines/video_readers.py loads them) and diffusers' transformer classes (what
# `getattr(diffusers, "WanTransformer3DModel")` imports: ~190 modules) were imported again by
# every worker's first job, ~0.6 CPU-s each. FSDP2 and DCP (with torch.distributed.tensor, ~1.8
# CPU-s): dit_train imports them only where a run shards or checkpoints (dit_train/sharded.py),
# which every layout job does. A module missing here (decord off x86_64) is skipped.
PRELOAD = ["dit_train", "torch", "torch.distributed", "dit_train.engine.layout_equivalence", "tests.pool", "peft",
           "av", "decord", "diffusers.models.transformers", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "torch.distributed.checkpoint.state_dict"]


def _context() -> Any:
    """A fork server that has imported PRELOAD: a worker costs a fork, not a fresh Python importing
    torch and dit_train (~5 CPU-seconds each; the suite starts ~20 workers, the 8-worker layouts 8 at
    once on 2 cores). The server itself is a fresh Python that ran nothing but imports (no torch
    op, no OpenMP team, no gloo thread), so what the workers inherit is what spawn would give them."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class WorkerPool:
    def __init__(self, world: int):
        ctx = _context()
        self.world = world
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=_serve, args=(r, world, port, self.jobs[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.broken = False
        self.paused = False

    def _signal(self, sig: int) -> None:
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, sig)

    def pause(self) -> None:
        """Stop the workers (SIGSTOP) between jobs. An idle worker is not idle: each gloo group it
        holds keeps a thread that wakes ~100 times a second, and a worker holds the groups of every
        layout it ran (reused meshes, below). 14 live workers of the 2-, 4- and 8-worker pools
        with 10 layouts' meshes took 0.12 CPU-s every second while no job ran — over a 14-minute
        suite ~100 CPU-seconds, taken from the pool that works. Stopped, they cost nothing; their
        sockets wait in the kernel, and nothing runs on them until `resume`."""
        if not self.paused:
            self._signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            self._signal(signal.SIGCONT)
            self.paused = False

    def run(self, fn: Callable[..., Any], args: tuple) -> dict[int, Any]:
        self.resume()
        try:
            return self._run(fn, args)
        finally:
            if not self.broken:
                self.pause()

    def _run(self, fn: Callable[..., Any], args: tuple) -> dict[int, Any]:
        packed = _pack(args)  # each worker its own copy, as the real launcher's pickled args
        for q in self.jobs:
            q.put((fn, packed))
        out: dict[int, Any] = {}
        errors = []
        for _ in range(self.world):
            try:
                rank, ok, value = self.results.get(timeout=JOB_TIMEOUT_S)
            except queue.Empty:
                self.broken = True
                raise WorkerFailed(f"no result from every rank within {JOB_TIMEOUT_S} s") from None
            if ok:
                out[rank] = _unpack(value)
            else:
                errors.append((rank, value))
        if errors:
            self.broken = True
            rank, tb = errors[0]
            raise WorkerFailed(f"worker rank {rank} failed:\n{tb}")
        return out

    def close(self) -> None:
        self.resume()
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


class Pools:
    """One pool per world size, started on first use, replaced after a failure."""

    def __init__(self):
        self.pools: dict[int, WorkerPool] = {}
        atexit.register(self._resume_all)  # before multiprocessing's exit handler ends the daemon workers

    def _resume_all(self) -> None:
        for pool in self.pools.values():
            pool.resume()

    def launch_local(self, fn: Callable[..., Any], args: tuple, nproc: int, cfg: Any = None) -> dict[int, Any]:
        pool = self.pools.get(nproc)
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            pool = self.pools[nproc] = WorkerPool(nproc)
        return pool.run(fn, args)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
