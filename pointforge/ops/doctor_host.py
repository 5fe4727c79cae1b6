"""Doctor's checks of the machine: Python, torch and CUDA, GPUs and CUDA_VISIBLE_DEVICES, ports, tmux."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

from pointforge.ops.doctor_report import Check
from pointforge.ops.host import GpuInventory, format_gpu_list, port_free, port_owner
from pointforge.train.preflight import FAILURE, OK, WARNING

DEFAULT_PORT = 29500  # torchrun's default rendezvous/master port


# --------------------------------------------------------------------------- software


def check_python() -> Check:
    version = platform.python_version()
    if sys.version_info < (3, 10):
        return Check("python", FAILURE, f"{version} at {sys.executable}", "pointforge needs Python 3.10 or newer")
    return Check("python", OK, f"{version} at {sys.executable}")


def check_torch(needs_cuda: bool) -> list[Check]:
    try:
        import torch
    except Exception as err:  # a broken install
        return [
            Check("torch", FAILURE, f"cannot import torch ({err})", "install torch: make test, or pip install torch")
        ]
    checks = []
    cuda_build = torch.version.cuda
    if cuda_build is None:
        status = FAILURE if needs_cuda else OK
        checks.append(
            Check(
                "torch",
                status,
                f"{torch.__version__} (CPU-only build: no CUDA)",
                'install a CUDA build of torch, e.g. make test TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu124"',
            )
        )
        return checks
    checks.append(Check("torch", OK, f"{torch.__version__} (built for CUDA {cuda_build})"))
    try:
        available = torch.cuda.is_available()
    except Exception as err:
        available, why = False, str(err)
    else:
        why = "torch.cuda.is_available() is False"
    if available:
        checks.append(
            Check(
                "CUDA",
                OK,
                f"runtime {cuda_build}, driver OK, {torch.cuda.device_count()} device(s) visible to this process",
            )
        )
    else:
        checks.append(
            Check(
                "CUDA",
                FAILURE if needs_cuda else WARNING,
                f"CUDA not usable: {why}",
                "check the NVIDIA driver (nvidia-smi) and that the driver supports CUDA " + str(cuda_build),
            )
        )
    try:
        cudnn = torch.backends.cudnn.version()
    except Exception:
        cudnn = None
    checks.append(
        Check(
            "cuDNN",
            OK if cudnn else WARNING,
            str(cudnn) if cudnn else "not available",
            "install a torch build that bundles cuDNN (the standard CUDA wheels do)",
        )
    )
    try:
        nccl = torch.cuda.nccl.version()
        nccl_text = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        checks.append(Check("NCCL", OK, nccl_text))
    except Exception as err:
        checks.append(
            Check(
                "NCCL",
                FAILURE if needs_cuda else WARNING,
                f"not available ({err})",
                "multi-GPU training needs NCCL: use the standard Linux CUDA wheels of torch",
            )
        )
    return checks


# --------------------------------------------------------------------------- GPUs


def check_gpus(
    inventory: GpuInventory, *, physical_needed: list[int] | None, visible_needed: int | None
) -> list[Check]:
    """GPUs on the machine versus what a plan (physical numbers) or a job in this shell (visible count) needs."""
    checks = []
    detail = inventory.describe()
    if inventory.has_details:
        names = sorted({g.name for g in inventory.gpus})
        detail += ": " + ", ".join(names)
    if physical_needed:
        missing = [g for g in physical_needed if g >= inventory.count]
        if missing:
            checks.append(
                Check(
                    "GPUs",
                    FAILURE,
                    f"{detail}; the plan uses GPU {format_gpu_list(physical_needed)}",
                    f"GPU {format_gpu_list(missing)} does not exist: number GPUs 0-{max(inventory.count - 1, 0)} as nvidia-smi does",
                )
            )
        else:
            checks.append(Check("GPUs", OK, f"{detail}; the plan uses GPU {format_gpu_list(physical_needed)}"))
    elif visible_needed:
        visible = _visible_count(inventory)
        if visible < visible_needed:
            checks.append(
                Check(
                    "GPUs",
                    FAILURE,
                    f"{detail}; {visible} visible to this shell, the run needs {visible_needed}",
                    f"use --nproc {visible} or fewer, or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
                    if visible
                    else "run on a machine with GPUs, or use run.device=cpu",
                )
            )
        else:
            checks.append(
                Check("GPUs", OK, f"{detail}; {visible} visible to this shell, the run needs {visible_needed}")
            )
    else:
        checks.append(Check("GPUs", OK, detail + ("" if inventory.count else "; training runs on the CPU")))
    return checks


def _visible_count(inventory: GpuInventory) -> int:
    if inventory.fake:
        return inventory.count
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return inventory.count
    tokens = [t.strip() for t in mask.split(",") if t.strip()]
    count = 0
    for token in tokens:  # CUDA stops at the first invalid entry
        if token.isdigit() and int(token) >= inventory.count:
            break
        count += 1
    return count


def check_visible_devices(inventory: GpuInventory, *, for_plan: bool, gpus_needed: bool) -> Check:
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    name = "CUDA_VISIBLE_DEVICES"
    if mask is None:
        return Check(name, OK, "unset: every GPU is visible")
    if for_plan:
        return Check(name, OK, f"{mask!r} in this shell; pointforge launch replaces it with each job's own GPUs")
    tokens = [t.strip() for t in mask.split(",")]
    if mask.strip() == "":
        status = FAILURE if gpus_needed else WARNING
        return Check(
            name,
            status,
            "set but empty: every GPU is hidden from this shell",
            "unset CUDA_VISIBLE_DEVICES, or list the GPUs to use",
        )
    problems = []
    seen = set()
    for token in tokens:
        if token.isdigit():
            n = int(token)
            if inventory.count and n >= inventory.count:
                problems.append(
                    f"GPU {n} does not exist (this machine has 0-{inventory.count - 1}): CUDA reports 'invalid device ordinal'"
                )
            if n in seen:
                problems.append(f"GPU {n} is listed twice")
            seen.add(n)
        elif not token.upper().startswith(("GPU-", "MIG-")):
            problems.append(f"{token!r} is neither a GPU number nor a GPU-/MIG- UUID")
    if problems:
        return Check(
            name,
            FAILURE,
            f"{mask!r}: " + "; ".join(problems),
            "unset it (an inherited value from another job is the usual cause) or list existing GPUs, e.g. CUDA_VISIBLE_DEVICES=0,1",
        )
    if len(seen) > 1 and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and not inventory.fake:
        return Check(
            name,
            WARNING,
            f"{mask!r} without CUDA_DEVICE_ORDER=PCI_BUS_ID: CUDA may number GPUs differently from nvidia-smi",
            "export CUDA_DEVICE_ORDER=PCI_BUS_ID (pointforge launch sets it for its jobs)",
        )
    return Check(name, OK, f"{mask!r}: {len(tokens)} GPU(s) visible, as cuda:0 … cuda:{len(tokens) - 1}")


# --------------------------------------------------------------------------- ports, tmux, run dir


def check_port(port: int, *, asked: bool) -> Check:
    name = f"port {port}"
    if port_free(port):
        return Check(name, OK, "free for a rendezvous" + ("" if asked else " (torchrun's default)"))
    owner = port_owner(port)
    by = f" by pid {owner}" if owner else ""
    fix = "choose another port (--rdzv-endpoint HOST:PORT / --master-port), or stop what holds it" + (
        "; pointforge launch picks a free port per job by itself" if not asked else ""
    )
    return Check(name, FAILURE if asked else WARNING, f"in use{by}", fix)


def check_tmux(asked: bool) -> Check | None:
    exe = shutil.which("tmux")
    if exe is None:
        if not asked:
            return None
        return Check(
            "tmux",
            FAILURE,
            "not installed",
            "install tmux (apt-get install tmux), or run pointforge launch without --tmux (jobs run detached)",
        )
    try:
        version = subprocess.run([exe, "-V"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        version = exe
    return Check("tmux", OK, version or exe)
