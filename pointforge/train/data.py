"""Distributed batching with equal step counts by construction, seeds, and loader lifetime.

The default sampler works in *global* batches: each epoch the dataset is
shuffled with a generator seeded by (seed, epoch) — the same permutation on
every rank — cut into ``global_batch``-sized chunks (the incomplete last one is
dropped), and each chunk is split into ``world_size × accumulation``
micro-batches, one set per rank. So every rank has exactly
``len(dataset) // global_batch`` optimizer steps per epoch, and the samples
that make up optimizer step *s* do not depend on the number of ranks: two
ranks with batch *b* see what one rank with batch *2b* sees.

Each epoch's batches are materialised as index lists before the epoch starts.
That makes the step count exact (not a ``__len__`` promise) so it can be
compared across ranks up front, and makes resuming mid-epoch a slice.
"""

from __future__ import annotations

import contextlib
import random
import re
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from pointforge.errors import DataError, UserError


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from any mix of ints and labels (stable across runs and machines)."""
    words: list[int] = []
    for part in parts:
        if isinstance(part, str):
            words.extend(part.encode())
        else:
            words.append(int(part) & 0xFFFFFFFF)
            words.append((int(part) >> 32) & 0xFFFFFFFF)
    state = np.random.SeedSequence(words).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def global_batches(
    n_items: int,
    *,
    global_batch: int,
    micro_batch: int,
    accumulation: int,
    world_size: int,
    rank: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
) -> list[list[int]]:
    """This rank's micro-batches for one epoch, in training order (see module docs)."""
    if n_items < global_batch:
        raise DataError(
            f"the training set has {n_items} samples, fewer than data.global_batch={global_batch}; "
            "lower data.global_batch or add data"
        )
    if shuffle:
        gen = torch.Generator()
        gen.manual_seed(derive_seed(seed, "shuffle", epoch))
        order = torch.randperm(n_items, generator=gen).tolist()
    else:
        order = list(range(n_items))
    batches: list[list[int]] = []
    for step in range(n_items // global_batch):
        chunk = order[step * global_batch : (step + 1) * global_batch]
        for micro in range(accumulation):
            start = (micro * world_size + rank) * micro_batch
            batches.append(chunk[start : start + micro_batch])
    return batches


def eval_shard(n_items: int, *, rank: int, world_size: int, batch: int) -> list[list[int]]:
    """This rank's share of an evaluation set in fixed order (strided, uneven allowed)."""
    mine = list(range(rank, n_items, world_size))
    return [mine[i : i + batch] for i in range(0, len(mine), batch)]


class EpochBatches:
    """A batch sampler whose batches are replaced each epoch.

    One DataLoader (and, with ``persistent_workers``, one set of workers)
    serves the whole run; the engine swaps the epoch's list in before
    iterating. Workers only ever receive indices from it.
    """

    def __init__(self) -> None:
        self._batches: list[list[int]] = []

    def set(self, batches: Sequence[Sequence[int]]) -> None:
        self._batches = [list(b) for b in batches]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches)

    def __len__(self) -> int:
        return len(self._batches)


def build_loader(
    dataset: Dataset,
    batch_sampler: Iterable[list[int]],
    *,
    collate_fn: Callable[[list[Any]], Any],
    data_cfg: Any,
    pin_memory: bool,
    generator: torch.Generator,
    persistent: bool | None = None,
) -> DataLoader:
    """A DataLoader over ``batch_sampler`` with the configured worker settings.

    ``generator`` decides the workers' base seed (reseed it per rank and epoch);
    passing it also keeps the loader from drawing on the global torch RNG,
    whose state is part of what a checkpoint must reproduce.
    """
    workers = int(data_cfg.num_workers)
    kwargs: dict[str, Any] = {}
    if workers > 0:
        kwargs["prefetch_factor"] = int(data_cfg.prefetch_factor)
        kwargs["persistent_workers"] = bool(data_cfg.persistent_workers if persistent is None else persistent)
        kwargs["timeout"] = float(data_cfg.worker_timeout_s)
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=workers,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
        generator=generator,
        **kwargs,
    )


def shutdown_loader(loader: DataLoader | None, iterator: Any = None) -> None:
    """Stop worker processes now (rather than at garbage collection), also after errors."""
    for it in (iterator, getattr(loader, "_iterator", None)):
        stop = getattr(it, "_shutdown_workers", None)
        if callable(stop):
            with contextlib.suppress(Exception):
                stop()
    if loader is not None and getattr(loader, "_iterator", None) is not None:
        loader._iterator = None


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Tensors anywhere in dicts, lists, tuples (named too) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: move_to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device, non_blocking) for v in batch)
    to = getattr(batch, "to", None)
    if callable(to):
        return to(device)
    return batch


# What torch's ExceptionWrapper makes of an error raised in a loader worker:
# "Caught DataError in DataLoader worker process 1.\nOriginal Traceback (most recent call last): ..."
_WORKER_ERROR = re.compile(r"^Caught (\w+) (in DataLoader worker process \d+)\.\nOriginal Traceback")


def unwrap_worker_error(err: BaseException) -> BaseException | None:
    """The error a DataLoader worker raised, as its own one-line message; None if ``err`` is not one.

    torch re-raises a worker's exception with the worker's whole traceback as
    its message. A :class:`~pointforge.errors.UserError` (a missing or broken
    data file) gets its own line back, unchanged; any other error gets the
    traceback's last line and says which worker raised it.
    """
    text = str(err)
    match = _WORKER_ERROR.match(text)
    if match is None:
        return None
    name, where = match.groups()
    last = next((line for line in reversed(text.splitlines()) if line.strip()), "")
    found = re.match(rf"^(?:[\w.]+\.)?{re.escape(name)}: (.*)$", last)
    message = found.group(1) if found else last.strip()
    if isinstance(err, UserError):
        return type(err)(message)
    try:
        return type(err)(f"{message} (raised {where})")
    except Exception:
        return RuntimeError(f"{name}: {message} (raised {where})")


@contextlib.contextmanager
def worker_errors() -> Iterator[None]:
    """Re-raise an error from a DataLoader worker as the worker's own one-line error (:func:`unwrap_worker_error`)."""
    try:
        yield
    except Exception as err:
        plain = unwrap_worker_error(err)
        if plain is None:
            raise
        raise plain from None
