"""Keeping a multi-process job alive (MegaScale §4): heartbeats, detection, self-checks, restart.

Two rooms over one shared floor:

  events.py   the one definition of a heartbeat and of a failure (worker and driver share it)
  faults.py   the fault grammar (--fault=kill:rank=1:step=37, ...): what a fault is, who
              injects it
  worker/     what runs inside a training process: joining `jax.distributed`, the heartbeat
              client, injecting faults, the self-check probes a restarted group runs
  driver/     the supervisor outside the workers: it starts, watches and restarts the group
              (its HTTP heartbeat server, warm standby processes, Slurm/Kubernetes job files)

`worker/` and `driver/` never import each other; what the driver sees of a worker's loop
(straggler detection, hang localisation, the merged timeline) is `mscale_jax/observability/`.
"""
