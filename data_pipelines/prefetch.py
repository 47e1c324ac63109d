"""Background decoding of the samples a rank will read next (`data.num_workers` threads).

The trainer announces the sample ids of the current and the next step (`prefetch(ids)`);
worker threads decode them while the model runs (decord and torch's resize release the GIL).
Reading a sample returns the decoded result of its worker, or decodes it in the caller's
thread if nobody started it. `dataset[i]` is a pure function of `i`, so what a step sees is
the same for any number of workers: only the time it waits changes.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable


class Prefetcher:
    """Wraps a dataset (`lengths()`, `__getitem__`) with background decoding.

    Errors (e.g. `VideoReadError`) raised in a worker are re-raised when the sample is read, so
    callers handle them exactly as without workers. Results are handed out once (memory stays
    at about two steps of samples); ids announced but not read within `keep_calls` later
    `prefetch` calls are dropped.
    """

    def __init__(self, dataset: Any, num_workers: int, keep_calls: int = 2):
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1 (use the dataset directly for 0)")
        self.dataset = dataset
        self.num_workers = num_workers
        self.keep_calls = keep_calls
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[int, tuple[Future, int]] = {}  # id -> (result, prefetch call that asked)
        self._calls = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # skipped, entries, text_dim, null_text_emb, ...
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __len__(self) -> int:
        return len(self.dataset)

    def lengths(self) -> list[int]:
        return self.dataset.lengths()

    def captions(self) -> list[str] | None:
        inner = getattr(self.dataset, "captions", None)
        return inner() if inner is not None else None

    def prefetch(self, ids: Iterable[int]) -> None:
        """Start decoding `ids` in the background (ids already started are not started again)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="decode")
            self._calls += 1
            for i in ids:
                if i in self._pending:
                    self._pending[i] = (self._pending[i][0], self._calls)
                else:
                    self._pending[i] = (self._pool.submit(self.dataset.__getitem__, i), self._calls)
            for i in [i for i, (_, c) in self._pending.items() if c <= self._calls - self.keep_calls]:
                self._pending.pop(i)[0].cancel()  # announced long ago and never read

    def __getitem__(self, i: int) -> Any:
        with self._lock:
            fut = self._pending.pop(i, None)
        if fut is None:
            return self.dataset[i]
        return fut[0].result()

    def pending(self) -> list[int]:
        with self._lock:
            return sorted(self._pending)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            self._pending.clear()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
