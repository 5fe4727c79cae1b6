"""A real, one-host Slurm cluster for the tests marked ``slurm``.

:class:`SlurmCluster` writes a minimal ``slurm.conf`` into a temporary folder
and starts ``munged``, ``slurmctld`` and two ``slurmd`` daemons, all as root
and all with their state, sockets, logs and ports under that folder, so
nothing on the machine is touched and two clusters never meet.

Why two ``slurmd`` on one host: a multi-node job needs ``SLURM_JOB_NUM_NODES``
= 2, one ``srun`` task per node and a first node to hold the rendezvous, as on
a real cluster. Debian's ``slurmd`` accepts ``-N NODENAME``, so two node
names (``pf1``, ``pf2``) share this host: ``NodeHostname`` is this host's
short name (what ``slurmd`` checks it runs on), ``NodeAddr=127.0.0.1`` with a
``Port`` of its own for each. Each claims this host's CPUs
(``SlurmdParameters=config_overrides`` lets the configured CPUs stand).
Without cgroups in a container: ``ProctrackType=proctrack/linuxproc`` (a
step's processes are found by parent pid, so a signal reaches torchrun's
workers too) and ``TaskPlugin=task/none``. No accounting daemon: ``sacct``
has nothing to say here, ``squeue`` and ``scontrol`` do.

Where Slurm cannot start (not root, packages missing, a daemon that does not
come up) :func:`skip_reason` says why in one line and the tests skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

NODES = ("pf1", "pf2")
PARTITION = "pf"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "sinfo")


def skip_reason() -> str | None:
    """Why no Slurm can be started here, or None."""
    if os.geteuid() != 0:
        return "Slurm tests need root (they start munged, slurmctld and slurmd); run them as root or in CI"
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurmctld slurmd slurm-client munge"
    return None


def _free_ports(count: int) -> list[int]:
    socks, ports = [], []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class SlurmCluster:
    """munged + slurmctld + one slurmd per node name, configured under ``root``; ``env`` finds them."""

    def __init__(self, root: Path, cpus: int | None = None):
        self.root = root
        self.cpus = cpus or max(2, os.cpu_count() or 2)
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge.sock"
        self.pids: list[int] = []

    @property
    def env(self) -> dict[str, str]:
        """Variables that point Slurm's commands at this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def config_text(self) -> str:
        ctld, *node_ports = _free_ports(1 + len(NODES))
        r = self.root
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus} State=UNKNOWN"
            for n, p in zip(NODES, node_ports)
        )
        return f"""\
ClusterName=pointforge
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={ctld}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool-%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SlurmctldParameters=enable_configless
SlurmdParameters=config_overrides
JobRequeue=1
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=10
MinJobAge=600
MessageTimeout=5
{nodes}
PartitionName={PARTITION} Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""

    def start(self, timeout: float = 30.0) -> None:
        r = self.root
        r.mkdir(parents=True, exist_ok=True)
        (r / "state").mkdir(exist_ok=True)
        for n in NODES:
            (r / f"spool-{n}").mkdir(exist_ok=True)
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.conf.write_text(self.config_text())
        self._daemon(
            [
                "munged",
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={r}/munged.pid",
                f"--log-file={r}/munged.log",
                f"--seed-file={r}/munged.seed",
            ],
            r / "munged.pid",
        )
        self._daemon(["slurmctld", "-f", str(self.conf), "-i"], r / "slurmctld.pid")
        for n in NODES:
            self._daemon(["slurmd", "-f", str(self.conf), "-N", n], r / f"slurmd-{n}.pid")
        self.wait_idle(timeout)

    def _daemon(self, cmd: list[str], pid_file: Path) -> None:
        """Start a forking daemon and remember its pid (from its pid file)."""
        done = subprocess.run(cmd, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"{cmd[0]} did not start: {(done.stderr or done.stdout).strip()[-500:]}")
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                self.pids.append(int(pid_file.read_text().split()[0]))
                return
            except (FileNotFoundError, ValueError, IndexError):
                time.sleep(0.05)
        raise RuntimeError(f"{cmd[0]} wrote no pid file {pid_file}")

    def run(self, *cmd: str, check: bool = True) -> str:
        """One Slurm command against this cluster; its stdout."""
        done = subprocess.run(list(cmd), env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
        return done.stdout

    def wait_idle(self, timeout: float) -> None:
        end, states = time.monotonic() + timeout, ""
        while time.monotonic() < end:
            states = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            idle = {line.split()[0] for line in states.splitlines() if line.split()[1:] == ["idle"]}
            if idle >= set(NODES):
                return
            time.sleep(0.2)
        raise RuntimeError(f"Slurm nodes not idle after {timeout:.0f} s: {states.strip()!r}; see {self.root}/*.log")

    def job_state(self, job_id: str) -> str:
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return ""

    def stop(self) -> None:
        """Every job cancelled, every daemon ended (by the pids this cluster started)."""
        if self.conf.exists():
            self.run("scancel", "--full", "-u", "root", check=False)
        for pid in reversed(self.pids):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            end = time.monotonic() + 10
            while time.monotonic() < end and _alive(pid):
                time.sleep(0.05)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.pids.clear()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A daemon that exited but is not reaped (it forked away from us) shows as a zombie.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
