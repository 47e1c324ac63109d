"""Which samples make a step, and how they are packed into micro-batches.

The set of samples of step s is a pure function of (seed, s, dataset size, global_batch):
never of the number of processes. Only *where* each sample goes depends on the layout:

    global batch --(balance tokens, or modelled time)--> data-parallel ranks
                 --(balance tokens, or modelled time)--> grad_accum groups per rank
                 --(first-fit-decreasing, token budget)--> micro-batches

Every rank computes the whole plan locally from the token counts, so no communication is
needed, and every rank runs the same number of micro-batches (ranks with less work get empty
micro-batches: FSDP's collectives must match across ranks).

train.balance=cost balances by a `StepCost` instead of tokens: a step's time grows with Σ T_b²
(attention) as well as Σ T_b, so equal tokens can mean very unequal work, and every rank waits
for the slowest at the gradient reduce. The exact loss makes placement free (a sample's weight
does not depend on its rank or micro-batch), so only where samples go changes, never which.
"""
from __future__ import annotations

import functools
import hashlib
import heapq
from dataclasses import dataclass
from typing import Any, Callable, Iterable

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


def batch_size_at(step: int, global_batch: int, warmup_steps: int = 0, warmup_start: int = 0) -> int:
    """Samples in the global batch of `step` (train.batch_warmup_steps / batch_warmup_start).

    Linear ramp from `warmup_start` (0 = max(1, global_batch // 8)) at step 0 to global_batch at
    step warmup_steps, rounded down; global_batch from then on. A function of the step only, so
    every layout trains on the same samples.
    """
    if step >= warmup_steps:
        return global_batch
    start = warmup_start or max(1, global_batch // 8)
    return start + (global_batch - start) * step // warmup_steps


@functools.lru_cache(maxsize=16)
def _warmup_positions(num_samples: int, global_batch: int, warmup_steps: int, warmup_start: int) -> tuple:
    """(epoch, offset) where each warm-up step's slice starts, and where step warmup_steps would
    start before its epoch check: O(warmup_steps) once, so planning any step is O(1) after."""
    epoch, offset, out = 0, 0, []
    for s in range(warmup_steps):
        b = batch_size_at(s, global_batch, warmup_steps, warmup_start)
        if offset + b > num_samples:  # a step never straddles two epochs (no sample twice)
            epoch, offset = epoch + 1, 0
        out.append((epoch, offset))
        offset += b
    out.append((epoch, offset))
    return tuple(out)


def step_position(step: int, num_samples: int, global_batch: int, warmup_steps: int = 0,
                  warmup_start: int = 0) -> tuple[int, int, int]:
    """(epoch, offset, size): step `step` takes perm_epoch[offset:offset + size].

    Samples are consumed as a stream of epochs (each a fresh seeded permutation); a step whose
    slice would cross the end of its epoch starts the next one instead (the rest of the epoch is
    dropped). Without warm-up this is step // spe, (step % spe)·global_batch: the same samples as
    ever for a given seed.
    """
    spe = steps_per_epoch(num_samples, global_batch)
    if spe == 0:
        raise ValueError(f"train.global_batch={global_batch} is larger than the dataset ({num_samples} samples)")
    positions = _warmup_positions(num_samples, global_batch, warmup_steps, warmup_start)
    if step < warmup_steps:
        epoch, offset = positions[step]
        return epoch, offset, batch_size_at(step, global_batch, warmup_steps, warmup_start)
    epoch, offset = positions[warmup_steps]
    if offset + global_batch > num_samples:
        epoch, offset = epoch + 1, 0
    left = (num_samples - offset) // global_batch  # full steps left in the current epoch
    j = step - warmup_steps
    if j < left:
        return epoch, offset + j * global_batch, global_batch
    e, k = divmod(j - left, spe)
    return epoch + 1 + e, k * global_batch, global_batch


def step_samples(step: int, num_samples: int, global_batch: int, seed: int, warmup_steps: int = 0,
                 warmup_start: int = 0) -> list[int]:
    """The global batch of `step`: a slice of a seeded permutation of the dataset.

    Each epoch is a fresh permutation; the samples left at an epoch's end that do not fill a
    step are dropped so a step never holds the same sample twice (noise is keyed by sample id).
    With a batch-size warm-up the first `warmup_steps` steps take fewer samples
    (`batch_size_at`).
    """
    epoch, offset, size = step_position(step, num_samples, global_batch, warmup_steps, warmup_start)
    perm = np.random.default_rng([seed, epoch, 0x5A17]).permutation(num_samples)
    return [int(i) for i in perm[offset:offset + size]]


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


@dataclass(frozen=True)
class StepCost:
    """Modelled time of one micro-batch on one rank, in seconds:

        per_micro + Σ_b (per_sample + per_token·T_b + per_sq_token·T_b²)

    T_b: tokens of sample b before the CP split (the coefficients already divide by the CP
    degree). Built from the model's shapes and FLOP model by dit_train/perf/cost.py; a function
    of the config only, never measured at run time, so every rank computes the same plan.
    StepCost(per_token=1) is token balancing. lockstep: the ranks wait for each other at every
    micro-batch (FSDP2 sharding over DP ranks: `lockstep_time`), not only at the gradient
    reduce (`rank_times`)."""

    per_token: float
    per_sq_token: float = 0.0
    per_sample: float = 0.0
    per_micro: float = 0.0
    lockstep: bool = False

    def sample(self, tokens: int) -> float:
        """Seconds of one sample of `tokens` tokens (its share of a micro-batch)."""
        return self.per_sample + self.per_token * tokens + self.per_sq_token * tokens * tokens

    def micro(self, tokens: Iterable[int]) -> float:
        """Seconds of one micro-batch whose samples have `tokens` tokens (an empty one still
        runs: per_micro)."""
        return self.per_micro + sum(self.sample(t) for t in tokens)


def rank_times(micro_batches: list[list[list[int]]], lengths: dict[int, int], cost: StepCost) -> list[float]:
    """Modelled seconds of each rank's micro-batches (micro_batches[rank][k] = sample ids): the
    step time when ranks meet only at the gradient reduce (DDP, one micro-batch a rank)."""
    return [sum(cost.micro(lengths[i] for i in mb) for mb in rank) for rank in micro_batches]


def lockstep_time(micro_batches: list[list[list[int]]], lengths: dict[int, int], cost: StepCost) -> float:
    """Modelled seconds of a step whose ranks wait for each other at every micro-batch,
    Σ_k max_rank: FSDP2 all-gathers each layer's weights in every micro-batch's forward and
    backward, so the k-th micro-batches of all ranks run side by side (>= max(rank_times))."""
    return sum(max(cost.micro(lengths[i] for i in rank[k]) for rank in micro_batches)
               for k in range(len(micro_batches[0])))


IMPROVE_TRIES = 4  # groups, heaviest first, that one refinement round tries to lower


def cost_split(ids: list[int], weights: dict[int, float], parts: int,
               fits: Callable[[list[int]], bool] | None = None) -> list[list[int]] | None:
    """`parts` groups of similar total weight, each one that `fits` accepts (None = any):
    longest-processing-time first (each sample, heaviest first, to the lightest group it fits
    into), then moves and swaps that lower a group without raising the other above it,
    heaviest groups first. None when a sample fits no group.

    LPT alone leaves 10-30% of imbalance when groups hold a few samples of very different
    weights (the common case here: one long clip weighs as much as dozens of short ones).
    Deterministic (ties by id and group index): every rank computes the same groups. Each group
    lists its samples heaviest first.
    """
    fits = fits or (lambda group: True)
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0.0] * parts
    lightest = [(0.0, j) for j in range(parts)]  # a heap of (load, group)
    for i in sorted(ids, key=lambda i: (-weights[i], i)):
        full = []
        while lightest and not fits(groups[lightest[0][1]] + [i]):
            full.append(heapq.heappop(lightest))
        if not lightest:
            return None
        _, g = heapq.heappop(lightest)
        groups[g].append(i)
        load[g] += weights[i]
        for entry in [*full, (load[g], g)]:
            heapq.heappush(lightest, entry)
    for _ in range(len(ids)):  # each round lowers one group's load: a bound, rarely reached
        if not _improve(groups, load, weights, fits):
            break
    return [sorted(g, key=lambda i: (-weights[i], i)) for g in groups]


def _improve(groups: list[list[int]], load: list[float], weights: dict[int, float],
             fits: Callable[[list[int]], bool]) -> bool:
    """Apply the best move (a sample out of group h) or swap (a lighter one back) with a group
    o below the mean that lowers max(load h, load o) and leaves both groups fitting, for the
    heaviest of the IMPROVE_TRIES heaviest groups h that has one; False when none does. (Only
    the heaviest groups set the step's time; trying every group costs O(groups · samples) a
    round: seconds a step at DP 64.)"""
    mean = sum(load) / len(load)
    below = [o for o in range(len(groups)) if load[o] < mean]
    for h in sorted(range(len(groups)), key=lambda j: (-load[j], j))[:IMPROVE_TRIES]:
        if load[h] <= mean:
            break
        limit, cands = load[h] * (1 - 1e-9), []
        for o in below:
            gap = load[h] - load[o]
            for i in groups[h]:
                if max(load[h] - weights[i], load[o] + weights[i]) < limit:
                    cands.append((max(load[h] - weights[i], load[o] + weights[i]), o, i, -1))
                for j in groups[o]:
                    d = weights[i] - weights[j]
                    if 0 < d < gap and max(load[h] - d, load[o] + d) < limit:
                        cands.append((max(load[h] - d, load[o] + d), o, i, j))
        for _, o, i, j in sorted(cands):
            new_h = [k for k in groups[h] if k != i] + ([j] if j >= 0 else [])
            new_o = [k for k in groups[o] if k != j] + [i]
            if fits(new_h) and fits(new_o):
                groups[h], groups[o] = new_h, new_o
                load[h] = sum(weights[k] for k in new_h)
                load[o] = sum(weights[k] for k in new_o)
                return True
    return False


def _pad(per_rank: list[list[list[int]]]) -> list[list[list[int]]]:
    """Every rank the same number of micro-batches (at least one): empty ones where it has fewer."""
    m = max(1, max(len(r) for r in per_rank))
    for r in per_rank:
        r.extend([] for _ in range(m - len(r)))
    return per_rank


def _token_plan(ids: list[int], lengths: dict[int, int], dp: int, grad_accum: int, budget: int) -> list[list[list[int]]]:
    """Ranks, then accumulation groups, balanced by tokens; each group first-fit-decreasing."""
    per_rank = []
    for rank_ids in balanced_split(ids, lengths, dp):
        micro = []
        for group in balanced_split(rank_ids, lengths, grad_accum):
            micro.extend(pack_ffd(group, lengths, budget))
        per_rank.append(micro)
    return _pad(per_rank)


def _by_ranks(ids: list[int], lengths: dict[int, int], weights: dict[int, float], dp: int, budget: int,
              m: int) -> list[list[list[int]]] | None:
    """Ranks balanced by modelled time (`cost_split`, each rank's samples packable into `m`
    micro-batches), then each rank's samples split into `m` micro-batches of similar time under
    the token budget (first-fit-decreasing where that split finds none), heaviest first. None
    when the samples do not fit dp ranks of m micro-batches that way."""
    def cell(group: list[int]) -> bool:
        return sum(lengths[i] for i in group) <= budget

    ranks = cost_split(ids, weights, dp, lambda group: len(pack_ffd(group, lengths, budget)) <= m)
    if ranks is None:
        return None
    per_rank = []
    for rank_ids in ranks:
        micro = [mb for mb in cost_split(rank_ids, weights, m, cell) or pack_ffd(rank_ids, lengths, budget) if mb]
        per_rank.append(sorted(micro, key=lambda mb: -sum(weights[i] for i in mb)) + [[] for _ in range(m - len(micro))])
    return per_rank


def _by_cells(ids: list[int], lengths: dict[int, int], weights: dict[int, float], dp: int, budget: int,
              m: int) -> list[list[list[int]]] | None:
    """dp·m micro-batches balanced against each other (`cost_split` under the token budget),
    then dealt in rounds: the dp heaviest are every rank's first, the next dp its second, ...,
    each round's heaviest to the rank with the least so far. The k-th micro-batches of all ranks
    (which FSDP runs side by side) and the ranks' totals both weigh alike. None when the
    samples do not fit dp·m micro-batches that way."""
    cells = cost_split(ids, weights, dp * m, lambda g: sum(lengths[i] for i in g) <= budget)
    if cells is None:
        return None
    cells.sort(key=lambda c: -sum(weights[i] for i in c))  # stable: ties keep cost_split's order
    per_rank: list[list[list[int]]] = [[] for _ in range(dp)]
    load = [0.0] * dp
    for k in range(m):
        for r, cell in zip(sorted(range(dp), key=lambda r: (load[r], r)), cells[k * dp:(k + 1) * dp]):
            per_rank[r].append(cell)
            load[r] += sum(weights[i] for i in cell)
    return per_rank


def place(ids: list[int], lengths: dict[int, int], dp: int, grad_accum: int, budget: int,
          cost: StepCost | None = None) -> list[list[list[int]]]:
    """micro_batches[dp_rank][k]: where the samples `ids` go, every rank the same number of
    micro-batches, each within `budget` tokens (the memory limit the planner sizes:
    activations, and the score blocks of kernels that materialise them, grow with it).

    cost=None: ranks and accumulation groups balanced by tokens, then first-fit-decreasing.
    With a `cost`: the same number of micro-batches M as that token plan, filled by modelled
    time — by ranks, then each rank's M micro-batches (`_by_ranks`), or by balancing all dp·M
    micro-batches
    (`_by_cells`) — whichever models fastest: `lockstep_time` when the ranks run micro-batch
    by micro-batch (cost.lockstep: FSDP2), else the slowest rank's total. The token plan is
    kept unless one of them models strictly faster. Which samples: `ids`, whatever the cost.
    """
    tokens = _token_plan(ids, lengths, dp, grad_accum, budget)
    if cost is None:
        return tokens
    m = len(tokens[0])
    weights = {i: cost.sample(lengths[i]) for i in ids}

    def time(plan: list[list[list[int]]]) -> float:
        return lockstep_time(plan, lengths, cost) if cost.lockstep else max(rank_times(plan, lengths, cost))

    best, best_t = tokens, time(tokens)
    for plan in (_by_ranks(ids, lengths, weights, dp, budget, m), _by_cells(ids, lengths, weights, dp, budget, m)):
        if plan is not None and time(plan) < best_t:
            best, best_t = plan, time(plan)
    return best


def plan_step(step: int, lengths: list[int] | dict[int, int], global_batch: int, dp: int, grad_accum: int,
              budget: int, seed: int, warmup_steps: int = 0, warmup_start: int = 0,
              cost: StepCost | None = None) -> StepPlan:
    """The full plan of one optimizer step for a data-parallel degree `dp` (with a batch-size
    warm-up, a small step may leave ranks or accumulation groups empty: they run empty packs).
    cost: train.balance=cost's model (`place`); the samples are the same with or without it."""
    lengths = dict(enumerate(lengths)) if isinstance(lengths, list) else lengths
    ids = step_samples(step, len(lengths), global_batch, seed, warmup_steps, warmup_start)
    return StepPlan(step, ids, place(ids, lengths, dp, grad_accum, budget, cost))


def plan_fingerprint(lengths: list[int], captions: list[str] | None = None) -> dict[str, object]:
    """What the step plan depends on besides (seed, step, batch settings): the number of samples
    and their lengths, as {"samples": n, "lengths_sha256": hex digest}; with `captions` (sources
    that have them) also {"captions_sha256": ...}, so clips replaced by others of the same sizes
    are seen too. Stored in checkpoints: a resume on data whose fingerprint differs would draw
    other samples than the run it continues."""
    digest = hashlib.sha256(np.asarray(lengths, dtype=np.int64).tobytes()).hexdigest()
    out: dict[str, object] = {"samples": len(lengths), "lengths_sha256": digest}
    if captions is not None:
        out["captions_sha256"] = hashlib.sha256("\x00".join(captions).encode("utf-8", "surrogatepass")).hexdigest()
    return out


def data_fingerprint(dataset: Any, lengths: list[int]) -> dict[str, object]:
    """What a resume compares with the checkpoint's data: plan_fingerprint of the lengths, and of
    the captions where the dataset has them (`captions()`: clips replaced by others of the same
    sizes change it)."""
    captions = getattr(dataset, "captions", None)
    return plan_fingerprint(lengths, captions() if captions is not None else None)


def padding_efficiency(lengths: list[int], micro_batches: list[list[int]], padded_len: int) -> float:
    """valid tokens / allocated tokens when every micro-batch is padded to `padded_len`."""
    valid = sum(lengths[i] for mb in micro_batches for i in mb)
    return valid / max(1, padded_len * len(micro_batches))
