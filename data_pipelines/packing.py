"""Which samples make a step, and how they are packed into micro-batches.

The set of samples of step s is a pure function of (seed, s, dataset size, global_batch):
never of the number of processes. Only *where* each sample goes depends on the layout:

    global batch --(balance tokens)--> data-parallel ranks
                 --(balance tokens)--> grad_accum groups per rank
                 --(first-fit-decreasing, token budget)--> micro-batches

Every rank computes the whole plan locally from the token counts, so no communication is
needed, and every rank runs the same number of micro-batches (ranks with less work get empty
micro-batches: FSDP's collectives must match across ranks).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepPlan:
    step: int
    sample_ids: list[int]  # the global batch, in its seeded order
    # micro_batches[dp_rank][k] = sample ids of micro-batch k on that rank (may be empty)
    micro_batches: list[list[list[int]]]

    @property
    def num_micro(self) -> int:
        return len(self.micro_batches[0])


def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    return num_samples // global_batch


def step_samples(step: int, num_samples: int, global_batch: int, seed: int) -> list[int]:
    """The global batch of `step`: a slice of a seeded permutation of the dataset.

    Each epoch is a fresh permutation; the last num_samples % global_batch samples of an epoch
    are dropped so a step never holds the same sample twice (noise is keyed by sample id).
    """
    spe = steps_per_epoch(num_samples, global_batch)
    if spe == 0:
        raise ValueError(f"train.global_batch={global_batch} is larger than the dataset ({num_samples} samples)")
    epoch, k = divmod(step, spe)
    perm = np.random.default_rng([seed, epoch, 0x5A17]).permutation(num_samples)
    return [int(i) for i in perm[k * global_batch:(k + 1) * global_batch]]


def balanced_split(ids: list[int], lengths: dict[int, int], parts: int) -> list[list[int]]:
    """Longest-processing-time split into `parts` groups of similar token totals.

    Deterministic: longest first (ties by id), each to the lightest group (ties by index).
    Groups keep the longest-first order.
    """
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(ids, key=lambda i: (-lengths[i], i)):
        g = min(range(parts), key=lambda j: (load[j], j))
        groups[g].append(i)
        load[g] += lengths[i]
    return groups


def pack_ffd(ids: list[int], lengths: dict[int, int], budget: int) -> list[list[int]]:
    """First-fit-decreasing bin packing: every bin's token total stays <= budget."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(ids, key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if n > budget:
            raise ValueError(f"sample {i} has {n} tokens, more than train.micro_batch_tokens={budget}; "
                             f"raise train.micro_batch_tokens or lower data.max_frames / the resolution")
        for b, r in enumerate(room):
            if n <= r:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return bins


def plan_step(step: int, lengths: list[int] | dict[int, int], global_batch: int, dp: int, grad_accum: int,
              budget: int, seed: int) -> StepPlan:
    """The full plan of one optimizer step for a data-parallel degree `dp`."""
    lengths = dict(enumerate(lengths)) if isinstance(lengths, list) else lengths
    ids = step_samples(step, len(lengths), global_batch, seed)
    per_rank = []
    for rank_ids in balanced_split(ids, lengths, dp):
        micro = []
        for group in balanced_split(rank_ids, lengths, grad_accum):
            micro.extend(pack_ffd(group, lengths, budget))
        per_rank.append(micro)
    m = max(1, max(len(r) for r in per_rank))
    for r in per_rank:
        r.extend([] for _ in range(m - len(r)))
    return StepPlan(step, ids, per_rank)


def padding_efficiency(lengths: list[int], micro_batches: list[list[int]], padded_len: int) -> float:
    """valid tokens / allocated tokens when every micro-batch is padded to `padded_len`."""
    valid = sum(lengths[i] for mb in micro_batches for i in mb)
    return valid / max(1, padded_len * len(micro_batches))
