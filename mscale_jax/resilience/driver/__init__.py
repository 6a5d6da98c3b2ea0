"""The supervisor of a multi-process job (MegaScale §4.1): it carries no tensors.

  supervisor.py  starts the worker group, watches it, restarts it from the latest checkpoint
  server.py      the HTTP/JSON endpoint the workers' heartbeats arrive at
  standby.py     warm standby worker processes (libraries imported) that restarts start from
  cluster.py     Slurm batch script and Kubernetes JobSet manifest from the launcher's flags
  blame.py       who is at fault for what the driver sees (signals, reports, exits, fatal lines)
  claim.py       the driver's claim on a workdir: a relaunch resumes the job of a dead driver
  injector.py    faults from outside the workers (SIGSTOP, a busy core, a corrupt checkpoint, ...)
"""
