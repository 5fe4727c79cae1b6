"""What this machine has: GPUs (physical numbering), free ports, live processes.

Shared by ``launch`` (GPU partitions, rendezvous ports, "is that job still
running?"), ``monitor`` (the GPU table, crashed runs) and ``doctor``.

GPU numbers are *physical*: the numbers ``nvidia-smi`` shows, in PCI bus
order, whatever ``CUDA_VISIBLE_DEVICES`` this shell happens to hold. Jobs
started by ``pointforge launch`` get ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that
CUDA numbers the GPUs the same way.

``POINTFORGE_FAKE_GPUS=N`` makes this module report N GPUs without asking any
driver: the launcher and doctor then plan for N GPUs, and the launcher runs
each job on the CPU (gloo) through the same code. It is how the tests, and a
rehearsal on a laptop, exercise multi-GPU plans.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from pointforge.errors import ConfigError
from pointforge.train.torchrun import pid_alive

FAKE_GPUS_ENV = "POINTFORGE_FAKE_GPUS"


# --------------------------------------------------------------------------- GPUs


@dataclass
class GpuProcess:
    pid: int
    memory_mb: float | None = None


@dataclass
class GpuInfo:
    index: int
    name: str = ""
    uuid: str | None = None
    utilization_pct: float | None = None
    memory_used_mb: float | None = None
    memory_total_mb: float | None = None
    temperature_c: float | None = None
    processes: list[GpuProcess] = field(default_factory=list)


@dataclass
class GpuInventory:
    """The GPUs of this machine, as far as it can be told without CUDA."""

    count: int
    source: str  # "fake", "nvml", "nvidia-smi", "/proc/driver/nvidia", "torch", "none"
    gpus: list[GpuInfo] = field(default_factory=list)  # details, when the source gives them
    note: str = ""

    @property
    def fake(self) -> bool:
        return self.source == "fake"

    @property
    def has_details(self) -> bool:
        return bool(self.gpus)

    def describe(self) -> str:
        if self.fake:
            return f"{self.count} faked GPU(s) ({FAKE_GPUS_ENV}={self.count}; jobs run on the CPU)"
        if self.count == 0:
            return "no GPUs (no NVIDIA driver, NVML or nvidia-smi found)"
        return f"{self.count} GPU(s) (from {self.source})"


def fake_gpu_count(environ: dict[str, str] | None = None) -> int | None:
    """The faked GPU count from ``POINTFORGE_FAKE_GPUS``, or None when it is not set."""
    env = os.environ if environ is None else environ
    raw = env.get(FAKE_GPUS_ENV)
    if raw is None or raw.strip() == "":
        return None
    try:
        count = int(raw)
    except ValueError:
        count = -1
    if count < 0:
        raise ConfigError(
            f"{FAKE_GPUS_ENV}={raw!r} is not a GPU count; set it to a whole number such as 8, or unset it"
        )
    return count


def _num(text: str) -> float | None:
    text = text.strip()
    if not text or text.startswith("[") or text.lower() in ("n/a", "nan"):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _from_nvml() -> list[GpuInfo] | None:
    try:
        import pynvml  # optional: nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            info = GpuInfo(index=index, name=name.decode() if isinstance(name, bytes) else str(name))
            for attr, getter in (
                ("uuid", lambda: pynvml.nvmlDeviceGetUUID(handle)),
                ("utilization_pct", lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)),
                ("temperature_c", lambda: float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))),
            ):
                try:
                    value = getter()
                    setattr(info, attr, value.decode() if isinstance(value, bytes) else value)
                except Exception:
                    pass
            try:
                mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
                info.memory_used_mb, info.memory_total_mb = mem.used / 2**20, mem.total / 2**20
            except Exception:
                pass
            try:
                for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = getattr(proc, "usedGpuMemory", None)
                    info.processes.append(GpuProcess(int(proc.pid), used / 2**20 if isinstance(used, int) else None))
            except Exception:
                pass
            gpus.append(info)
        return gpus
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _run_smi(args: list[str]) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def parse_smi_gpus(text: str) -> list[GpuInfo]:
    """``nvidia-smi --query-gpu=index,name,uuid,utilization.gpu,memory.used,memory.total,temperature.gpu``."""
    gpus = []
    for row in csv.reader(io.StringIO(text)):
        if len(row) < 7:
            continue
        try:
            index = int(row[0])
        except ValueError:
            continue
        gpus.append(
            GpuInfo(
                index=index,
                name=row[1].strip(),
                uuid=row[2].strip() or None,
                utilization_pct=_num(row[3]),
                memory_used_mb=_num(row[4]),
                memory_total_mb=_num(row[5]),
                temperature_c=_num(row[6]),
            )
        )
    return gpus


def parse_smi_apps(text: str, gpus: list[GpuInfo]) -> None:
    """``nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory``: attach processes to their GPUs."""
    by_uuid = {g.uuid: g for g in gpus if g.uuid}
    for row in csv.reader(io.StringIO(text)):
        if len(row) < 3:
            continue
        gpu = by_uuid.get(row[0].strip())
        pid = _num(row[1])
        if gpu is not None and pid is not None:
            gpu.processes.append(GpuProcess(int(pid), _num(row[2])))


def _from_smi() -> list[GpuInfo] | None:
    text = _run_smi(
        [
            "--query-gpu=index,name,uuid,utilization.gpu,memory.used,memory.total,temperature.gpu",
            "--format=csv,noheader,nounits",
        ]
    )
    if text is None:
        return None
    gpus = parse_smi_gpus(text)
    apps = _run_smi(["--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"])
    if apps:
        parse_smi_apps(apps, gpus)
    return gpus


def _from_proc() -> int | None:
    folder = Path("/proc/driver/nvidia/gpus")
    try:
        return len([p for p in folder.iterdir() if p.is_dir()])
    except OSError:
        return None


def gpu_inventory(*, details: bool = True) -> GpuInventory:
    """This machine's GPUs, numbered physically (as nvidia-smi numbers them).

    In order: the faked count (``POINTFORGE_FAKE_GPUS``), NVML (when
    ``nvidia-ml-py`` is installed), ``nvidia-smi``, the driver's
    ``/proc/driver/nvidia/gpus``, and torch (only when ``CUDA_VISIBLE_DEVICES``
    is unset, since a mask hides physical GPUs from it).
    """
    fake = fake_gpu_count()
    if fake is not None:
        return GpuInventory(fake, "fake", note=f"GPUs are faked ({FAKE_GPUS_ENV}={fake})")
    for source, reader in (("nvml", _from_nvml), ("nvidia-smi", _from_smi)):
        found = reader()
        if found is not None:
            return GpuInventory(len(found), source, found if details else [])
    count = _from_proc()
    if count is not None:
        return GpuInventory(count, "/proc/driver/nvidia", note="no GPU information (NVML not available, no nvidia-smi)")
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        try:
            import torch

            if torch.cuda.is_available():
                return GpuInventory(
                    torch.cuda.device_count(), "torch", note="no GPU information (NVML not available, no nvidia-smi)"
                )
        except Exception:
            pass
    return GpuInventory(0, "none", note="no GPU information (NVML not available, no nvidia-smi)")


def parse_gpu_list(value: object, where: str) -> list[int]:
    """``[0, 1]``, ``7``, ``"0-6"``, ``"0-3,6"`` → sorted physical GPU numbers (ConfigError otherwise)."""
    if isinstance(value, bool):
        value = str(value)
    if isinstance(value, int):
        items: list[object] = [value]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, str):
        items = [p.strip() for p in value.split(",") if p.strip()]
    else:
        raise ConfigError(f'{where}: gpus must be a list such as [0, 1] or a range such as "0-6", not {value!r}')
    found: list[int] = []
    for item in items:
        text = str(item).strip()
        try:
            if isinstance(item, int) and not isinstance(item, bool):
                numbers = [item]
            elif "-" in text.lstrip("-"):
                lo, hi = (int(x) for x in text.split("-", 1))
                if hi < lo:
                    raise ValueError
                numbers = list(range(lo, hi + 1))
            else:
                numbers = [int(text)]
        except ValueError:
            raise ConfigError(
                f'{where}: {text!r} is not a GPU number or range; write gpus like [0, 1], "0-6" or "0-3,6"'
            ) from None
        for n in numbers:
            if n < 0:
                raise ConfigError(f"{where}: GPU numbers start at 0, got {n}")
            if n in found:
                raise ConfigError(f"{where}: GPU {n} is listed twice; list each GPU once")
            found.append(n)
    if not found:
        raise ConfigError(f"{where}: gpus is empty; list the GPUs the job uses, or give `cpu: N` for a CPU job")
    return sorted(found)


def format_gpu_list(gpus: list[int]) -> str:
    """[0,1,2,3,6] → "0-3,6"."""
    parts, start = [], None
    for i, g in enumerate(gpus):
        if start is None:
            start = g
        if i + 1 == len(gpus) or gpus[i + 1] != g + 1:
            parts.append(str(start) if start == g else f"{start}-{g}")
            start = None
    return ",".join(parts)


# --------------------------------------------------------------------------- ports


def port_free(port: int) -> bool:
    """Whether a server could listen on ``port`` on every interface now (as torchrun's store does)."""
    families = [(socket.AF_INET, "0.0.0.0")]
    if socket.has_ipv6:
        families.append((socket.AF_INET6, "::"))
    for family, address in families:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no such address family on this machine
        try:
            # As a listening server would: TIME_WAIT leftovers do not count as "in use".
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((address, port))
        except OSError:
            return False
        finally:
            sock.close()
    return True


def pick_free_port(taken: set[int] | frozenset[int] = frozenset()) -> int:
    """A port the OS says is free now, not in ``taken``."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("0.0.0.0", 0))
            port = sock.getsockname()[1]
        if port not in taken and port_free(port):
            return port
    raise OSError("could not find a free TCP port")


def port_owner(port: int) -> int | None:
    """The pid listening on ``port`` when this user may see it (Linux), else None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(parts[9])
    if not inodes:
        return None
    targets = {f"socket:[{i}]" for i in inodes}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in targets:
                    return int(entry.name)
        except OSError:
            continue
    return None


# --------------------------------------------------------------------------- processes


def process_cmdline(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None


def pid_runs(pid: int | None, *needles: str) -> bool:
    """``pid`` is alive and (where /proc tells) its command line holds one of ``needles``.

    Guards against a recycled pid: a run's recorded pid, long after the run
    died, may belong to an unrelated process.
    """
    if not pid_alive(pid):
        return False
    cmdline = process_cmdline(int(pid))  # type: ignore[arg-type]
    if cmdline is None:
        return True
    return any(n in cmdline for n in needles)


def this_host() -> str:
    return socket.gethostname()
