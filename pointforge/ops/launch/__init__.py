"""``pointforge launch``: several training jobs on one machine, each on its own GPUs.

A plan (a YAML file, or ``--job NAME:TASK:GPUS[:CONFIG]`` flags) names jobs;
each gets

* its own GPUs: ``CUDA_VISIBLE_DEVICES`` set to its *physical* GPUs (the
  numbers nvidia-smi shows; ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` makes CUDA agree),
  so inside the job they are ``cuda:0 … cuda:k-1``, one process per GPU;
* its own rendezvous port, chosen free (or the plan's, checked free) and passed
  to torchrun as ``--rdzv-endpoint localhost:PORT``;
* its own run directory, log (``console.log`` beside the engine's ``train.log``)
  and environment: built afresh from this shell's for every job, with every
  variable a launcher or another job could leak (``CUDA_VISIBLE_DEVICES``,
  ``RANK``, ``MASTER_PORT``, ``TORCHELASTIC_*``, ...) removed first.

The modules, one job each:

* :mod:`~pointforge.ops.launch.spec` — the plan as written: the schema, the
  plan file and ``--job`` flags parsed and their keys checked;
* :mod:`~pointforge.ops.launch.plan` — the plan resolved and checked, whole,
  before anything starts: refused on the first look if two jobs share a GPU,
  a GPU does not exist, a port is in use, a run directory is in use by a live
  job, a config does not load, or a batch does not split over the job's GPUs;
* :mod:`~pointforge.ops.launch.start` — the jobs started, detached or in tmux;
* :mod:`~pointforge.ops.launch.stop` — launched jobs found and stopped.

``POINTFORGE_FAKE_GPUS=N`` plans for N GPUs on a machine without them; each
job then runs its processes on the CPU (``run.device=cpu``, gloo), so the whole
path can be rehearsed and tested anywhere.
"""
