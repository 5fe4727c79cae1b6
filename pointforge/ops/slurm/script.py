"""The sbatch script for one planned job: a pure function of the job, no Slurm needed.

One ``srun`` task per node, each running ONE torchrun agent
(``--nnodes $SLURM_JOB_NUM_NODES``, ``--nproc-per-node`` = GPUs per node),
all meeting at a ``c10d`` rendezvous on the allocation's first node, named by
the job id (the same across requeues, so a requeued job is one run). The
workers always run with ``--resume auto``: the first start finds no
checkpoint and starts afresh; every requeue continues from the newest one.

How the job ends, and what the batch shell does about it:

* ``SIGUSR1`` (Slurm's ``--signal=B:USR1@SECONDS`` before the time limit, or
  ``scancel --batch --signal=USR1``): the shell asks this node's workers to
  stop (SIGTERM: they finish the step together, save and exit 0), waits for
  the step to end, then ``scontrol requeue``\\ s the job, which resumes later
  on whatever nodes it gets.
* ``SIGTERM`` to the shell alone (``scancel --batch --signal=TERM``): the same stop, no
  requeue: the job ends COMPLETED, exit 0, with a checkpoint.
* A plain ``scancel`` or a preemption signals every process of the job: the
  workers get SIGTERM themselves and save before Slurm's ``KillWait`` ends.

One rank told to stop is enough: the ranks vote at every optimizer step, so
all of them stop at the same step (``pointforge.train.step``). The shell
finds this node's workers in the run dir's ``ranks/`` records.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

# Stand-ins that shlex leaves unquoted and the script replaces by shell expansions.
NNODES, ENDPOINT, RUN_ID = "@NNODES@", "@ENDPOINT@", "@RUN_ID@"
# Variables a launcher or an earlier job may leave in the submitting shell; torchrun sets its own.
UNSET = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class SlurmScript:
    """What the script needs: every value already checked (see :mod:`pointforge.ops.slurm.submit`)."""

    name: str
    run_dir: str
    python: str
    torchrun: list[str]  # torchrun_command(...) with the @NNODES@, @ENDPOINT@, @RUN_ID@ stand-ins
    nodes: int
    gpus_per_node: int  # 0: a CPU job (no gres)
    cpus_per_task: int | None = None
    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None  # Slurm's formats: MINUTES, HH:MM:SS, D-HH:MM:SS
    signal_before_s: int = 120
    gres_name: str = "gpu"
    port: int | None = None  # None: 20000 + job id mod 20000, so jobs sharing a first node differ
    env: dict[str, str] = field(default_factory=dict)
    extra_sbatch: list[str] = field(default_factory=list)


def sbatch_script(job: SlurmScript) -> str:
    """The whole batch script, ``#SBATCH`` lines first."""
    return "\n".join([*_header(job), *_body(job)]) + "\n"


def _header(job: SlurmScript) -> list[str]:
    out = f"{job.run_dir}/slurm-%j.out"
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job.name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if job.gpus_per_node:
        lines.append(f"#SBATCH --gres={job.gres_name}:{job.gpus_per_node}")
    if job.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={job.cpus_per_task}")
    if job.partition:
        lines.append(f"#SBATCH --partition={job.partition}")
    if job.account:
        lines.append(f"#SBATCH --account={job.account}")
    if job.time_limit:
        lines.append(f"#SBATCH --time={job.time_limit}")
    lines += [
        f"#SBATCH --signal=B:USR1@{job.signal_before_s}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={out}",
        f"#SBATCH --error={out}",
        *(f"#SBATCH {extra}" for extra in job.extra_sbatch),
    ]
    return lines


def _torchrun_line(job: SlurmScript) -> str:
    port = str(job.port) if job.port else "$((20000 + SLURM_JOB_ID % 20000))"
    line = shlex.join(job.torchrun)
    line = line.replace(NNODES, '"$SLURM_JOB_NUM_NODES"')
    line = line.replace(ENDPOINT, f'"$first_addr:{port}"')
    return line.replace(RUN_ID, '"$SLURM_JOB_ID"')


def _body(job: SlurmScript) -> list[str]:
    run_dir, python = shlex.quote(job.run_dir), shlex.quote(job.python)
    exports = [f"export {k}={shlex.quote(v)}" for k, v in job.env.items()]
    # This node's workers, from the ranks/ records the engine writes (train.torchrun.live_worker_pids).
    # This node's workers of this start of the job, from the ranks/ records the engine writes
    # (pointforge.train.torchrun.rank_records reads the same files): the standard library only, so the
    # stop is asked within a fraction of a second, not after torch has been imported.
    stop_workers = (
        f"{python} -c 'import glob, json, os, signal, socket, sys\n"
        "pids = []\n"
        'for path in glob.glob(os.path.join(sys.argv[1], "ranks", "rank*.json")):\n'
        "    try:\n"
        "        info = json.load(open(path))\n"
        '        if info["host"] == socket.gethostname() and info["started_at"] >= float(sys.argv[2]):\n'
        '            os.kill(int(info["pid"]), signal.SIGTERM)\n'
        '            pids.append(info["pid"])\n'
        "    except (OSError, ValueError, KeyError):\n"
        "        pass\n"
        'sys.exit(0 if pids else 1)\n\' "$RUN_DIR" "$began"'
    )
    status = (
        f'{python} -c \'import json, sys; print(json.load(open(sys.argv[1] + "/run.json")).get("status", ""))\' '
        '"$RUN_DIR" 2>/dev/null'
    )
    return [
        "",
        "# Written by pointforge slurm. Stop cleanly: scancel --batch --signal=TERM JOBID (checkpoint, exit 0);",
        "# checkpoint and requeue: scancel --batch --signal=USR1 JOBID (Slurm sends USR1 itself before the time limit).",
        "set -uo pipefail",
        f"RUN_DIR={run_dir}",
        "began=$(date +%s)",
        f"unset {' '.join(UNSET)}",
        *exports,
        'first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "# Where the first node listens: its NodeAddr (the node name itself on most clusters).",
        'first_addr=$(scontrol show node "$first_node" -o | tr " " "\\n" | sed -n "s/^NodeAddr=//p")',
        "first_addr=${first_addr:-$first_node}",
        "stop=''",
        "trap 'stop=requeue' USR1",
        "trap 'stop=${stop:-end}' TERM INT",
        'echo "pointforge: job $SLURM_JOB_ID start ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NUM_NODES node(s): '
        '$SLURM_JOB_NODELIST, rendezvous on $first_addr"',
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 {_torchrun_line(job)} &",
        "step=$!",
        "asked=''",
        'while kill -0 "$step" 2>/dev/null; do',
        '    if [ -n "$stop" ] && [ -z "$asked" ]; then',
        f'        {stop_workers} && asked=yes && echo "pointforge: $stop asked; workers saving a checkpoint"',
        "    fi",
        "    sleep 1 & wait $! 2>/dev/null",
        "done",
        'wait "$step"; code=$?',
        f"final=$({status})",
        'echo "pointforge: step ended with exit status $code, run status ${final:-unknown}"',
        'if [ "$stop" = requeue ] && [ "$final" = stopped ]; then',
        '    echo "pointforge: requeueing job $SLURM_JOB_ID; it resumes from the checkpoint"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$code"',
    ]
