"""Effective training time of one large job through its failures (pure Python, seeded).

  from mscale_jax.goodput import presets, simulate
  job = presets.megascale_job(gpus=12288)
  simulate.spread(job, seeds=range(20), hours=30 * 24).mean   # effective training time rate

Modules: job (what a job is: nodes, failure kinds and rates, detection, recovery, checkpoints),
simulate (the discrete-event simulator), analytic (Young/Daly intervals and the closed form the
simulator is tested against), sources (every cited, measured or assumed input with its source),
presets (jobs built from those inputs: MegaScale's setup, Llama 3's run, Meta's RSC clusters),
perf_adapter (iteration time from mscale_jax.perf), drill (reads results/fault_drill-*.json
records and replays them). See docs/goodput.md.
"""
