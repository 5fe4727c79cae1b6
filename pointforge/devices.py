"""The one device resolver: what ``auto``, ``cpu``, ``cuda`` and ``cuda:N`` mean here.

It sits in the lowest layer (beside :mod:`pointforge.errors`) so that every
user can call it: the engine for each rank (``local_rank``, ``world_size``),
the model loaders and the implant pipeline (one process, the defaults).
``setting`` names the option in messages (``run.device`` for training,
``device`` for the Python API), so the one clear line points at what to change.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Any, Optional

import torch

from pointforge.errors import ConfigError, DeviceError

__all__ = [
    "resolve_device",
    "visible_devices",
    "available_memory_bytes",
    "available_cores",
    "use_threads",
    "release_freed_memory",
    "map_large_blocks",
    "reuse_freed_memory",
]


def visible_devices() -> str:
    """The CUDA devices this process sees, in words (for error messages)."""
    if not torch.cuda.is_available():
        return "none (no CUDA device is visible)"
    names = [f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count())]
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    suffix = f"; CUDA_VISIBLE_DEVICES={mask}" if mask is not None else ""
    return ", ".join(names) + suffix


def _cuda_index(text: str, requested: object, setting: str) -> int:
    try:
        return int(text.split(":", 1)[1])
    except ValueError:
        raise ConfigError(f"{setting}={requested!r} is not a device; use auto, cpu, cuda or cuda:N") from None


def resolve_device(
    requested: str | torch.device | None = "auto",
    *,
    local_rank: int = 0,
    world_size: int = 1,
    setting: str = "device",
) -> torch.device:
    """The device to run on, or one DeviceError (ConfigError for text that is no device) saying what to use.

    ``auto``: this rank's GPU when there is one, else the CPU. ``cuda``: GPU
    ``local_rank`` (each rank of a multi-process run takes its own). ``cuda:N``
    pins one GPU, which only a single-process run may do.
    """
    text = (
        str(requested).strip().lower() if isinstance(requested, torch.device) else (requested or "auto").strip().lower()
    )
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if text == "cpu":
        return torch.device("cpu")
    if text == "auto":
        if cuda_count == 0:
            return torch.device("cpu")
        text = "cuda"
    if text == "cuda":
        if cuda_count == 0:
            raise DeviceError(
                f"{setting}=cuda but no CUDA device is visible (visible: {visible_devices()}); use {setting}=cpu or {setting}=auto"
            )
        if local_rank >= cuda_count:
            raise DeviceError(
                f"this process has LOCAL_RANK={local_rank} but only {cuda_count} CUDA device(s) are visible "
                f"({visible_devices()}); start at most {cuda_count} processes per node"
            )
        return torch.device("cuda", local_rank)
    if text.startswith("cuda:"):
        index = _cuda_index(text, requested, setting)
        if world_size > 1:
            raise DeviceError(
                f"{setting}={requested} pins one device, but this run has {world_size} ranks; "
                f"use {setting}=cuda (each rank takes cuda:LOCAL_RANK) and choose devices with CUDA_VISIBLE_DEVICES"
            )
        if index >= cuda_count:
            raise DeviceError(
                f"{setting}={requested} does not exist; visible devices: {visible_devices()}; use {setting}=cpu or {setting}=auto"
            )
        return torch.device("cuda", index)
    raise ConfigError(f"{setting}={requested!r} is not a device; use auto, cpu, cuda or cuda:N")


def _cgroup_headroom() -> int | None:
    """Bytes left under this process's cgroup memory limit (containers), if there is one."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = open(limit_file).read().strip()
            usage = int(open(usage_file).read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            return max(int(limit) - usage, 0)
        return None
    return None


def available_memory_bytes(device: torch.device | str) -> int:
    """Memory the device can still give: free plus cached on CUDA; on a CPU the
    kernel's MemAvailable, or less when a container's cgroup limit is closer."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    available = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = 1 << 62
    headroom = _cgroup_headroom()
    return available if headroom is None else min(available, headroom)


def _cgroup_cpu_quota() -> float | None:
    """CPUs this process's cgroup may use (cpu.max, or v1's cfs quota/period), if it is limited."""
    for quota_file, period_file in (
        ("/sys/fs/cgroup/cpu.max", None),
        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
    ):
        try:
            fields = open(quota_file).read().split()
            if period_file is not None:
                fields.append(open(period_file).read().strip())
            quota, period = fields[0], float(fields[1])
        except (OSError, ValueError, IndexError):
            continue
        if quota in ("max", "-1") or period <= 0:
            return None
        return float(quota) / period
    return None


def available_cores() -> int:
    """The cores this process may really run on: its CPU affinity, capped by a container's CPU quota.

    ``os.cpu_count()`` (and torch's default thread count) sees every core of the
    host, so in a container limited to 2 of 64 cores a 64-thread pool fights
    itself; this is the count to size thread pools with (at least 1).
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, int(quota)))
    return max(1, cores)


def use_threads(threads: int | None = None, setting: str = "--threads") -> int:
    """Size torch's CPU thread pool: ``threads``, or :func:`available_cores` when None. Returns the count."""
    if threads is None:
        threads = available_cores()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"{setting} must be a positive integer, got {threads!r}")
    torch.set_num_threads(threads)
    return threads


# --------------------------------------------------------------------------- the C heap (glibc)

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


@functools.lru_cache(maxsize=1)
def _libc() -> Optional[Any]:
    """The process's C library when it is glibc on Linux (it has ``malloc_trim``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded: the C library the interpreter runs on
        libc.malloc_trim, libc.mallopt  # musl and others have neither
    except (OSError, AttributeError):
        return None
    return libc


def release_freed_memory() -> bool:
    """Give the memory freed inside this process back to the system (glibc ``malloc_trim(0)``).

    glibc keeps freed blocks in its heaps for reuse, so a loop of large
    short-lived arrays (one tile after another through a network) can hold
    the high-water mark of every earlier step. False where there is nothing
    to call (not Linux, or not glibc): then it does nothing.
    """
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def map_large_blocks(threshold: int) -> bool:
    """Serve every allocation of ``threshold`` bytes or more by its own ``mmap``, returned to the system on free.

    glibc's default raises this threshold (up to 32 MiB) each time a mapped
    block is freed, after which arrays below it come from the heap, where
    freed holes are kept and fragment; setting it (glibc ``mallopt``) fixes it
    for the rest of the process. False, and nothing done, where there is no glibc.
    """
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)))


_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers in glibc's malloc.h
_M_MMAP_MAX = -4


def reuse_freed_memory() -> bool:
    """Keep freed memory in this process's C heap for the next allocation, never mapped anew.

    glibc gives every large block (from 128 KiB up to a threshold that rises to 32 MiB) its
    own ``mmap`` and returns it to the system on free, so a network that makes the same
    large temporaries pass after pass pays page faults for every fresh page each time
    (PVCNN2's paper forward measured it: docs/experiments/benchmarks.md). After
    this call (glibc ``mallopt``: no ``mmap`` for blocks, no automatic trimming of the heap)
    they are served from the heap, which keeps its high-water mark for the rest of the
    process until :func:`release_freed_memory` hands the free part back (the implant
    pipeline does so before each case). It overrides :func:`map_large_blocks`. False, and
    nothing done, where there is no glibc.
    """
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
