"""The ground floor's device facts: cores really available, memory, and the one device resolver."""

import os
import subprocess
import sys

import pytest
import torch

from pointforge import devices
from pointforge.devices import resolve_device
from pointforge.errors import ConfigError, DeviceError


def test_available_cores_is_the_affinity_capped_by_a_cpu_quota(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(devices, "_cgroup_cpu_quota", lambda: None)
    assert devices.available_cores() == 8
    for quota, cores in ((2.5, 2), (0.5, 1), (64.0, 8)):
        monkeypatch.setattr(devices, "_cgroup_cpu_quota", lambda quota=quota: quota)
        assert devices.available_cores() == cores


@pytest.mark.parametrize(
    "text, cpus", [("200000 100000\n", 2.0), ("max 100000\n", None), ("50000 100000", 0.5), ("garbage", None)]
)
def test_cgroup_v2_quota_is_read_from_cpu_max(monkeypatch, tmp_path, text, cpus):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(text)
    real_open = open

    def fake_open(path, *args, **kwargs):
        if path == "/sys/fs/cgroup/cpu.max":
            return real_open(cpu_max, *args, **kwargs)
        raise OSError("no such file")

    monkeypatch.setattr("builtins.open", fake_open)
    assert devices._cgroup_cpu_quota() == cpus


def test_use_threads_sizes_torchs_pool_and_refuses_nonsense():
    import torch

    from pointforge.errors import ConfigError

    before = torch.get_num_threads()
    try:
        assert devices.use_threads(1) == 1 and torch.get_num_threads() == 1
        assert devices.use_threads() == devices.available_cores() == torch.get_num_threads()
        for bad in (0, -2, 1.5, True):
            with pytest.raises(ConfigError, match="--threads must be a positive integer"):
                devices.use_threads(bad)
    finally:
        torch.set_num_threads(before)


def test_the_one_device_resolver():
    assert resolve_device("cpu") == torch.device("cpu") and resolve_device(torch.device("cpu")) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(DeviceError, match="device=cuda:3 does not exist"):
            resolve_device("cuda:3")
    with pytest.raises(ConfigError, match="is not a device"):
        resolve_device("tpu")


_HEAP_PROBE = """
import ctypes, sys
from pointforge import devices
if sys.argv[1] == "reuse":
    assert devices.reuse_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
block = libc.malloc(64 << 20)
heap = next(line for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]"))
start, end = (int(part, 16) for part in heap.split()[0].split("-"))
print(start <= block < end)
"""


@pytest.mark.skipif(devices._libc() is None, reason="needs glibc on Linux")
@pytest.mark.parametrize("mode", ["default", "reuse"])
def test_reuse_freed_memory_serves_large_blocks_from_the_heap(mode):
    # In a fresh process: the setting holds for the rest of the process that makes it.
    found = subprocess.run([sys.executable, "-c", _HEAP_PROBE, mode], capture_output=True, text=True, check=True)
    # glibc maps a 64 MiB block of its own by default; after the call it comes from the heap.
    assert found.stdout.strip() == ("True" if mode == "reuse" else "False"), found.stderr
