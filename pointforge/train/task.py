"""The Task contract: what a model family hands the training engine.

A task is everything the engine must not know: which network, which data,
what the loss is and how to evaluate. The engine owns everything a task must
not care about: devices, ranks, DDP, batching, accumulation, precision,
schedules, checkpoints, logging and signals. (Compare torchtitan's train specs
and Lightning modules.)

Write a task by subclassing :class:`Task`::

    @dataclass
    class MyConfig:                      # the `task:` section of the YAML file
        hidden: int = 64
        data_root: str = "data/skulls"

    class MyTask(Task):
        name = "mytask"
        Config = MyConfig
        best_metric = "val_loss"         # what `best.pt` is chosen by
        best_mode = "min"

        def build_model(self, cfg): return MyNet(cfg.hidden)
        def build_datasets(self, cfg): return TrainSet(cfg.data_root), ValSet(cfg.data_root)
        def training_step(self, model, batch, ctx):
            pred = model(batch["x"])
            loss = F.mse_loss(pred, batch["y"])
            return loss, {"mae": (pred - batch["y"]).abs().mean()}
        def evaluate(self, model, loader, ctx):
            ...; return {"val_loss": mean_loss}

and register it (:func:`pointforge.tasks.register_task`, or the
``pointforge.tasks`` entry-point group); the engine itself takes the
instance (``train(MyTask(), cfg)``). The contract, method by method:

``configure(cfg)``
    Optional; called first with the ``task`` config section. A task whose
    ``eval_on`` or ``best_metric`` depends on its config sets them here.

``build_model(cfg)``
    Returns the bare ``nn.Module`` on the CPU. The engine seeds the RNG
    identically on every rank first, moves the model to the device and wraps
    it (DDP, ``torch.compile``) itself. Never wrap it yourself. A task whose
    model cannot be compiled says why in ``compile_refusal``; the plan then
    refuses ``perf.compile=true`` before the first step.

``build_datasets(cfg)``
    Returns ``(train_dataset, val_dataset_or_None)``: map-style datasets
    (``__len__`` and ``__getitem__``). Called on every rank; must be
    deterministic (same items in the same order on every rank). A training
    dataset with a ``set_epoch(epoch)`` method gets it called before each
    epoch's batches are loaded; drawing per-item randomness from
    ``(seed, epoch, index)`` then makes augmentation identical on any worker
    count and on resume (persistent workers hold their own copy of the
    dataset, so keep the epoch in shared memory, as ``data.skulls`` does).

``batch_sampler(dataset, *, rank, world_size, micro_batch, accumulation, seed, epoch)``
    Optional. Return ``None`` (the default) to let the engine batch: shuffle
    per epoch, global batches, ``drop_last``, equal counts by construction.
    Return an iterable of index lists to batch yourself (e.g. by point
    budget). It must be deterministic for a given (seed, epoch) and give every
    rank the same number of batches; the engine materialises it each epoch,
    compares counts across ranks before the first step and fails with a
    message naming ranks and counts if they differ. Each optimizer step takes
    ``accumulation`` consecutive batches.

``collate(items)``
    Optional; default ``torch.utils.data.default_collate``. Runs in loader
    workers, so it must be picklable-friendly (a method of a module-level
    class is).

``training_step(model, batch, ctx)``
    One micro-batch: return the loss (a scalar tensor, the *mean* over the
    micro-batch), optionally with a dict of scalar metrics, as
    ``loss``, ``(loss, metrics)`` or :class:`StepOutput`. The batch is already
    on ``ctx.device``; autocast is already active when AMP is on. Do not call
    ``backward``, step optimizers or touch ranks: the engine scales for
    accumulation, syncs gradients, skips non-finite steps and clips. Random
    numbers must come from the global torch/numpy/python RNGs (seeded per
    rank; saved and restored with checkpoints) or generators you derive from
    ``ctx``, so that a resumed run repeats exactly. Metrics are averaged over
    the log interval on rank 0 (rank 0's shard); the loss is averaged over all
    ranks.

``evaluate(model, loader, ctx)``
    Optional. Gets the *bare* model (the EMA copy when EMA is on) in eval
    mode under ``torch.no_grad()``, and a loader over the validation set.
    Returns ``{"metric": float}``. Where it runs is declared by ``eval_on``:

    * ``"all"`` (default): every rank evaluates its own shard of the
      validation set; the engine combines the dicts as means weighted by
      shard size. Metrics must therefore be per-sample means.
    * ``"rank0"``: only rank 0 evaluates the whole set (for metrics that do
      not average, or expensive sampling); the other ranks wait outside any
      collective and receive the result.

    In either case ``evaluate`` must not use collectives or the DDP wrapper.
    It may write files under ``ctx.out_dir`` (rank 0's is the run dir's
    ``eval/epoch-NNNN``).

``health(metrics)``
    Optional: what an evaluation's metrics say has gone wrong (a model that
    collapsed to a trivial output), each a line of what to do about it. The
    engine logs each as a warning on rank 0 after every evaluation; training
    goes on. Default: nothing.

``parameters(model)``
    Optional: parameter groups for the optimizer (e.g. no weight decay on
    norms). Default: ``model.parameters()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable, Literal, Mapping, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate


@dataclass
class StepContext:
    """What a training step may know about where it runs."""

    epoch: int
    global_step: int  # optimizer steps completed before this one
    micro_step: int  # 0 .. accumulation-1 within the optimizer step
    accumulation: int
    device: torch.device
    rank: int
    world_size: int
    amp_dtype: torch.dtype | None


@dataclass
class EvalContext:
    epoch: int  # the epoch just finished (0-based)
    global_step: int
    device: torch.device
    rank: int
    world_size: int
    amp_dtype: torch.dtype | None
    out_dir: Path  # where evaluation may write files (samples, previews)
    micro_batch: int


@dataclass
class StepOutput:
    loss: torch.Tensor
    metrics: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class NoConfig:
    """For tasks without settings of their own."""


class Task:
    """Base class for tasks; see the module docs for the full contract."""

    name: ClassVar[str] = ""
    Config: ClassVar[type] = NoConfig
    # Class defaults that configure() may set per instance (see the module docs).
    eval_on: Literal["all", "rank0"] = "all"
    best_metric: str | None = None
    best_mode: Literal["min", "max"] = "min"
    # Why ``perf.compile=true`` cannot train this task (preflight refuses it with this reason); None: it can.
    compile_refusal: ClassVar[str | None] = None

    def configure(self, cfg: Any) -> None:
        """Called first with the task's config section; may adjust ``eval_on``/``best_metric``."""

    def build_model(self, cfg: Any) -> nn.Module:
        raise NotImplementedError(f"task {self.name!r} must implement build_model")

    def build_datasets(self, cfg: Any) -> tuple[Dataset, Dataset | None]:
        raise NotImplementedError(f"task {self.name!r} must implement build_datasets")

    def batch_sampler(
        self,
        dataset: Dataset,
        *,
        rank: int,
        world_size: int,
        micro_batch: int,
        accumulation: int,
        seed: int,
        epoch: int,
    ) -> Iterable[Sequence[int]] | None:
        return None

    def collate(self, items: list[Any]) -> Any:
        return default_collate(items)

    def training_step(self, model: nn.Module, batch: Any, ctx: StepContext) -> Any:
        raise NotImplementedError(f"task {self.name!r} must implement training_step")

    def evaluate(self, model: nn.Module, loader: DataLoader, ctx: EvalContext) -> Mapping[str, float]:
        return {}

    def health(self, metrics: Mapping[str, float]) -> Sequence[str]:
        return ()

    def parameters(self, model: nn.Module) -> Iterable[Any]:
        return model.parameters()

    def memory_estimate(self, cfg: Any, micro_batch: int) -> int | None:
        """Bytes one training step on ``micro_batch`` samples needs on its device, beyond the model; None: not estimated.

        The engine refuses, before the first step, a micro-batch whose estimate
        exceeds the device's available memory, naming the largest that fits.
        """
        return None

    def memory_savers(self, cfg: Any) -> Mapping[str, Any]:
        """Settings that lower :meth:`memory_estimate` without changing what is trained:
        ``{"key=value" override: the task config with it}``. When a micro-batch does not
        fit, the refusal names each one under which a larger micro-batch fits."""
        return {}


def split_step_output(out: Any) -> tuple[torch.Tensor, Mapping[str, Any]]:
    """Normalise what ``training_step`` returned to ``(loss, metrics)``."""
    if isinstance(out, StepOutput):
        loss, metrics = out.loss, out.metrics
    elif isinstance(out, tuple) and len(out) == 2:
        loss, metrics = out
    else:
        loss, metrics = out, {}
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"training_step must return a scalar loss tensor (optionally with a metrics dict), got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
    return (loss if loss.dim() == 0 else loss.reshape(())), (
        metrics if isinstance(metrics, dict) else dict(metrics or {})
    )
