"""``pointforge slurm``: a launch plan's jobs submitted to Slurm, one torchrun agent per node.

* :mod:`~pointforge.ops.slurm.script` — the sbatch script, a pure function of
  the checked job (srun + torchrun, c10d rendezvous on the first node, the
  pre-time-limit signal, checkpoint and requeue);
* :mod:`~pointforge.ops.slurm.submit` — the plan read per node, checked
  (sbatch, config, batch split, shared run dir, lock, earlier checkpoints),
  written into the run dir and submitted;
* :mod:`~pointforge.ops.slurm.queue` — the queue read back (``squeue``) for
  ``pointforge monitor``.

The train layer knows nothing of Slurm: its workers see only what torchrun
sets, and stop on SIGTERM as they do everywhere.
"""
