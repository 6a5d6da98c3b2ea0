"""What runs inside a training process (a worker) for the driver.

  distributed.py  joining the job (`jax.distributed`) as the MSCALE_* environment says
  heartbeat.py    the heartbeat client: phase, step progress, failures, host probes
  faults.py       injecting faults at the training loop's fault points (drills and tests)
  selfcheck.py    diagnostics a restarted group runs first: matmul rate, all-gather, ckpt write

The trainer reaches these through callbacks (mscale_jax/callbacks/worker.py); nothing here
imports the trainer.
"""
