"""Keeping a multi-process job alive (MegaScale §4): heartbeats, detection, self-checks, restart.

  events.py     the one definition of a heartbeat and of a failure (trainer and driver share it)
  worker.py     a worker joins the job (jax.distributed) and reports heartbeats; trainer hooks
  faults.py     fault injection for drills and tests (--fault=kill:rank=1:step=37, ...)
  server.py     the driver's HTTP/JSON heartbeat endpoint
  selfcheck.py  diagnostics a restarted group runs first: matmul rate, all-gather, ckpt-dir write
  standby.py    warm standby worker processes (libraries imported) that restarts start from
  driver.py     starts and supervises the worker group, restarts it from the latest checkpoint
  cluster.py    Slurm batch script and Kubernetes JobSet manifest from the launcher's flags
"""
