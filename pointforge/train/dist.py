"""The torchrun environment, the process group, devices and the guards against hangs.

Rules this module enforces for the engine:

* Each rank uses ``cuda:LOCAL_RANK`` *within* ``CUDA_VISIBLE_DEVICES``; nothing
  here ever sets ``CUDA_VISIBLE_DEVICES``, so two jobs on one node each see
  only the devices they were given.
* The process group has a timeout (``dist.timeout_s``, 10 minutes by default),
  so a dead or stuck rank ends the job instead of hanging it.
* Every rank records what it is doing (epoch, step, phase) in the rendezvous
  store; when a collective fails, the error names the rank that failed and
  what every rank was last doing.
* Step counts are compared *before* an epoch starts (:func:`check_equal`), so a
  rank with fewer batches is reported at once rather than leaving its peers in
  an all-reduce that never completes.
* Rank-0-only work (evaluation, saving) runs in :func:`rank0_section`: the
  other ranks wait on a store key, outside any collective, and learn at once
  if rank 0 failed.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from pointforge.devices import (
    resolve_device as _resolve_device,
    visible_devices,  # noqa: F401  (re-exported: the engine's error messages use it)
)
from pointforge.errors import ConfigError, DataError, DeviceError

T = TypeVar("T")


class RankDivergenceError(DataError):
    """Ranks would run different numbers of steps (a sampler or data bug)."""


class DistributedFailure(RuntimeError):
    """A collective failed or timed out, or rank 0 failed while the others waited for it."""


# --------------------------------------------------------------------------- devices


def resolve_device(requested: str, *, local_rank: int, world_size: int) -> torch.device:
    """The device this rank trains on (:func:`pointforge.devices.resolve_device`, the one resolver)."""
    return _resolve_device(requested, local_rank=local_rank, world_size=world_size, setting="run.device")


# --------------------------------------------------------------------------- environment


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    restart_count: int = 0
    host: str = field(default_factory=socket.gethostname)
    _store: Any = None
    _section: int = 0
    _heartbeat: Any = None

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def key(self, *parts: object) -> str:
        # Keys carry the restart count: torchrun's store outlives a restart, and
        # a restarted job must not read the previous attempt's answers.
        return "pointforge/" + "/".join(str(p) for p in (self.restart_count, *parts))

    def describe(self) -> str:
        return f"rank {self.rank}/{self.world_size} on {self.host} ({self.device})"


def env_from_torchrun() -> dict[str, int]:
    """RANK, WORLD_SIZE, LOCAL_RANK, ... as torchrun sets them (single-process defaults otherwise)."""

    def read(name: str, default: int) -> int:
        value = os.environ.get(name)
        if value is None or value == "":
            return default
        try:
            return int(value)
        except ValueError:
            raise ConfigError(
                f"environment variable {name}={value!r} is not an integer; it should be set by torchrun"
            ) from None

    return {
        "rank": read("RANK", 0),
        "world_size": read("WORLD_SIZE", 1),
        "local_rank": read("LOCAL_RANK", 0),
        "local_world_size": read("LOCAL_WORLD_SIZE", 1),
        "restart_count": read("TORCHELASTIC_RESTART_COUNT", 0),
    }


def _dist_env(device: torch.device, info: dict[str, int]) -> DistEnv:
    return DistEnv(
        device=device,
        rank=info["rank"],
        world_size=info["world_size"],
        local_rank=info["local_rank"],
        local_world_size=info["local_world_size"],
        restart_count=info["restart_count"],
    )


def probe_env(device: str) -> DistEnv:
    """The environment as it would be, without starting a process group (for --dry-run)."""
    info = env_from_torchrun()
    dev = resolve_device(device, local_rank=info["local_rank"], world_size=info["world_size"])
    return _dist_env(dev, info)


def init_distributed(device: str, backend: str = "auto", timeout_s: float = 600.0) -> DistEnv:
    """Set up this rank: device, and (when WORLD_SIZE > 1) the process group with a timeout."""
    info = env_from_torchrun()
    dev = resolve_device(device, local_rank=info["local_rank"], world_size=info["world_size"])
    env = _dist_env(dev, info)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if info["world_size"] <= 1:
        return env
    if not dist.is_available():
        raise DeviceError(
            "this torch build has no torch.distributed; install a standard torch build to train on several processes"
        )
    chosen = backend
    if chosen == "auto":
        chosen = "nccl" if dev.type == "cuda" else "gloo"
    if chosen == "nccl" and dev.type != "cuda":
        raise ConfigError("dist.backend=nccl needs CUDA devices; use dist.backend=gloo (or auto) for CPU training")
    if chosen == "nccl":
        # Without async error handling a timed-out NCCL collective blocks forever;
        # with it the watchdog aborts the process group and the job ends.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if not dist.is_initialized():
        timeout = _dt.timedelta(seconds=timeout_s)
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        # torchrun's c10d rendezvous shares one store across restart rounds, so
        # a restarted worker could read the previous attempt's addresses (gloo
        # then dials a dead peer). A prefix per attempt keeps rounds apart.
        store = dist.PrefixStore(f"pointforge/attempt-{info['restart_count']}", store)
        kwargs: dict[str, Any] = {
            "backend": chosen,
            "timeout": timeout,
            "store": store,
            "rank": rank,
            "world_size": world_size,
        }
        if chosen == "nccl":
            kwargs["device_id"] = dev
        dist.init_process_group(**kwargs)
    env.backend = chosen
    # The rendezvous store carries the heartbeats and the rank-0 hand-offs; it
    # lives in torchrun's agent, so it outlives a crashed worker.
    env._store = dist.distributed_c10d._get_default_store()
    env._heartbeat = Heartbeat(env).start()
    return env


def shutdown_distributed(env: DistEnv) -> None:
    if env._heartbeat is not None:
        env._heartbeat.stop()
        env._heartbeat = None
    if env.distributed and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# --------------------------------------------------------------------------- heartbeat / diagnostics


class Heartbeat:
    """A daemon thread that publishes this rank's phase to the store every ``interval_s``.

    The training loop only assigns a tuple (:meth:`set`, no I/O); the thread
    does the writing. Collectives release the GIL, so a rank waiting in one
    keeps beating, while a dead rank's beat stops: the failure message can
    tell "stuck in forward/backward for 40 s" from "gone 40 s ago".
    """

    def __init__(self, env: "DistEnv", interval_s: float = 1.0):
        self._env = env
        self._interval = interval_s
        self._state: tuple[str, dict[str, Any], float] = ("starting", {}, time.time())
        self._written: tuple[str, dict[str, Any], float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pointforge-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def set(self, phase: str, **info: Any) -> None:
        if self._state[0] != phase or self._state[1] != info:
            self._state = (phase, info, time.time())

    def _run(self) -> None:
        while not self._stop.is_set():
            self.beat()
            self._stop.wait(self._interval)

    def beat(self) -> None:
        phase, info, since = self._state
        payload = json.dumps(
            {"phase": phase, "since": since, "time": time.time(), "pid": os.getpid(), "host": self._env.host, **info}
        )
        try:
            self._env._store.set(self._env.key("phase", self._env.rank), payload)
        except Exception:
            self._stop.set()  # the store is gone: the job is ending

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self._interval)


def report(env: DistEnv, phase: str, **info: Any) -> None:
    """Record what this rank is doing, for error messages on other ranks (no I/O here)."""
    if env._heartbeat is not None:
        env._heartbeat.set(phase, **info)


def peer_reports(env: DistEnv) -> list[str]:
    """One line per rank: what it was doing, for how long, and when it last showed signs of life."""
    if env._store is None:
        return []
    if env._heartbeat is not None:
        env._heartbeat.beat()  # our own entry, current
    lines = []
    now = time.time()
    for rank in range(env.world_size):
        key = env.key("phase", rank)
        try:
            if not env._store.check([key]):
                lines.append(f"rank {rank}: no report yet")
                continue
            data = json.loads(env._store.get(key).decode())
        except Exception:
            lines.append(f"rank {rank}: unknown (the store could not be read)")
            continue
        where = ", ".join(f"{k} {v}" for k, v in data.items() if k in ("epoch", "step"))
        lines.append(
            f"rank {rank} (pid {data.get('pid')} on {data.get('host')}): {data.get('phase')}"
            f"{' at ' + where if where else ''} for {now - data.get('since', now):.0f} s, "
            f"last heartbeat {now - data.get('time', now):.0f} s ago"
        )
    return lines


def failure_message(env: DistEnv, doing: str, err: BaseException) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    lines = [f"rank {env.rank} failed while {doing}: {first}"]
    peers = peer_reports(env)
    if peers:
        lines.append("ranks: " + "; ".join(peers))
    return "\n".join(lines)


# --------------------------------------------------------------------------- collectives


def _collective_device(env: DistEnv) -> torch.device:
    return env.device if env.backend == "nccl" else torch.device("cpu")


def all_gather_ints(env: DistEnv, value: int) -> list[int]:
    if not env.distributed:
        return [int(value)]
    mine = torch.tensor([int(value)], dtype=torch.int64, device=_collective_device(env))
    out = [torch.zeros_like(mine) for _ in range(env.world_size)]
    dist.all_gather(out, mine)
    return [int(t.item()) for t in out]


def check_equal(env: DistEnv, value: int, what: str, hint: str) -> None:
    """All ranks must hold the same ``value``; otherwise every rank raises RankDivergenceError."""
    values = all_gather_ints(env, value)
    if len(set(values)) > 1:
        detail = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise RankDivergenceError(f"ranks disagree on {what} ({detail}); {hint}")


def all_reduce_sum(env: DistEnv, values: torch.Tensor) -> torch.Tensor:
    if not env.distributed:
        return values
    out = values.to(_collective_device(env))
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_gather_objects(env: DistEnv, obj: T) -> list[T]:
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(env: DistEnv, obj: T | None) -> T:
    if not env.distributed:
        return obj  # type: ignore[return-value]
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]  # rank 0 passes the object; the others get it


def rank0_section(env: DistEnv, doing: str, fn: Callable[[], T], *, timeout_s: float) -> T | None:
    """Run ``fn`` on rank 0 only; the other ranks wait for it outside any collective.

    Rank 0's JSON-able result (or its error) is published in the store, so the
    other ranks get the same result, or fail at once with rank 0's error
    instead of waiting for a collective timeout. Returns the result on every rank.
    """
    if not env.distributed:
        return fn()
    env._section += 1
    key = env.key("rank0", env._section)
    if env.is_main:
        report(env, doing)
        try:
            result = fn()
        except BaseException as err:
            with contextlib.suppress(Exception):
                env._store.set(key, json.dumps({"ok": False, "error": f"{type(err).__name__}: {err}"}))
            raise
        env._store.set(key, json.dumps({"ok": True, "result": result}, default=str))
        return result
    report(env, f"waiting for rank 0 ({doing})")
    # Poll rather than store.wait(): a blocking wait holds the store client's
    # lock for its whole duration and would silence this rank's heartbeat.
    deadline = time.monotonic() + timeout_s
    while not env._store.check([key]):
        if time.monotonic() > deadline:
            raise DistributedFailure(
                f"rank {env.rank} waited {timeout_s:.0f} s for rank 0 to finish {doing} (dist.rank0_timeout_s); "
                "rank 0 is stuck or gone\n" + "ranks: " + "; ".join(peer_reports(env))
            )
        time.sleep(0.05)
    answer = json.loads(env._store.get(key).decode())
    if not answer.get("ok"):
        raise DistributedFailure(f"rank 0 failed while {doing}: {answer.get('error')}")
    return answer.get("result")


# --------------------------------------------------------------------------- stop signals


class StopSignal:
    """SIGINT/SIGTERM set a flag that the engine checks at every optimizer step.

    The first signal asks for a graceful stop (finish the step, save, exit 0);
    repeats are noted and ignored, because torchrun forwards the signal that
    the terminal already delivered to every process.
    """

    def __init__(self, on_first: Callable[[str], None] | None = None):
        self.requested: str | None = None
        self._on_first = on_first
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested = name
            if self._on_first is not None:
                self._on_first(name)

    def install(self) -> "StopSignal":
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            with contextlib.suppress(Exception):
                signal.signal(sig, handler)
        self._previous.clear()


@contextlib.contextmanager
def stop_signals(on_first: Callable[[str], None] | None = None) -> Iterator[StopSignal]:
    stopper = StopSignal(on_first).install()
    try:
        yield stopper
    finally:
        stopper.uninstall()
