"""Labelled fleet traces for the Minder evaluation: per-second metrics of M machines training in
lockstep for hours, with faults of the kinds Minder's paper lists and healthy jitter.

The generator is the only place that knows where faults are: `generate` returns a `Trace` whose
`metrics` ({metric: float32 [machines, seconds]}) are all a detector is given
(experiments/minder_eval.py passes nothing else), and whose `faults` are the labels the scorer
reads afterwards.

Healthy model (per machine i, second t). Training is synchronous, so a step takes as long as the
slowest machine's own work plus communication: own_i = compute_i + data_wait_i +
host_to_device_i; step = max_i own_i + comm; sync_i = step - own_i (the time machine i waits for
the others, MegaScale's "fast ranks wait for the slow one"). Every metric gets a persistent
per-machine bias (healthy heterogeneity), multiplicative noise, and the job's shared rhythm
(a slow wave; every `checkpoint_every_s` a fleet-wide checkpoint stall; an evaluation pass).
Healthy jitter that must not be flagged: short single-machine blips (1 to 15 s: a GC pause, a
burst of logging, one slow batch) on a random metric, several per machine-hour of the fleet.

Calibration (CALIBRATION below, and where each number comes from): the phase proportions are
those of our own 2-process CPU job (results/observability_drill-cpu-20261123T165921.json,
timeline summary: dispatch 0.21 s, sync 0.028 s, data_wait 0.001 s, host_to_device 0.001 s of a
0.24 s iteration). The per-step noise of the host phases is the robust coefficient of variation
(1.4826 MAD / median) measured on a clean stretch of our own job's per-step timeline
(results/minder_calibration-cpu-20261126T053256.json: data_wait 0.15, host_to_device 0.16 to
0.18). The same record's compute (dispatch) noise, 0.6 to 0.9, is this host's: two CPU cores
shared by several sessions' jobs; a dedicated accelerator's step is far steadier, so the fleet
uses an assumed 2 % (the `compute_cv` flag of minder_eval changes it). The host and network
metrics (CPU use, resident memory, heartbeat round trip, NIC throughput) are not in our CPU runs'
records yet; their levels and noise are stated assumptions (a large-model job on 8-GPU hosts).

Faults (Minder §2 and Table 1 list ECC and CUDA errors, slow GPUs, PCIe downgrades, NIC and
network faults, memory and machine faults, hangs); each changes only what its cause would:
  slow_compute    the machine's compute time x (1.15 .. 1.6) (throttled or degraded GPU); the
                  whole step slows, the others wait longer, the slow one waits less.
  nic_degraded    its NIC throughput x (0.3 .. 0.7); communication (all machines) slows; its
                  heartbeat round trip rises.
  pcie_downgrade  its host-to-device time x (2 .. 4) and NIC throughput x (0.7 .. 0.9) (RDMA
                  crosses the same link).
  mem_pressure    its resident memory ramps up by 20 .. 60 %, CPU use +10 .. 30 points
                  (reclaim), data-loader wait x (1.5 .. 3).
  hang            the job stops: nobody completes a step (step-time metrics freeze at their last
                  value, NIC traffic stops); the hung machine's CPU use falls to ~2 % while the
                  others spin in their collective wait.
"""
import dataclasses

import numpy as np

METRICS = ("step_s", "compute_s", "sync_s", "data_wait_s", "host_to_device_s", "cpu_pct",
           "rss_gb", "hb_rtt_ms", "net_gbps")
STEP_PHASES = ("compute_s", "data_wait_s", "host_to_device_s")   # what a rank spends itself
_BLIP_METRICS = ("compute_s", "data_wait_s", "host_to_device_s", "cpu_pct", "rss_gb",
                 "hb_rtt_ms", "net_gbps")   # step and sync times follow from these
FAULT_KINDS = ("slow_compute", "nic_degraded", "pcie_downgrade", "mem_pressure", "hang")


@dataclasses.dataclass(frozen=True)
class Calibration:
  """Healthy levels (seconds per step or the metric's unit) and noise (coefficient of
  variation per sample; `bias` is the spread of per-machine persistent offsets)."""
  step_s: float = 2.0               # a large job's step (MegaScale: seconds); phases scale with it
  compute_frac: float = 0.875       # 0.21 / 0.24 (observability drill)
  data_wait_frac: float = 0.0043    # 0.00103 / 0.24
  h2d_frac: float = 0.0042          # 0.00101 / 0.24
  comm_frac: float = 0.10           # the rest of the step waiting in collectives
  compute_cv: float = 0.02         # assumed (see above)
  data_wait_cv: float = 0.15       # measured (robust CV)
  h2d_cv: float = 0.17             # measured (robust CV)
  comm_cv: float = 0.03
  cpu_pct: float = 110.0            # assumed: one busy Python thread plus the loader
  cpu_cv: float = 0.05
  rss_gb: float = 40.0              # assumed
  rss_cv: float = 0.003
  hb_rtt_ms: float = 0.6            # assumed: a LAN round trip
  hb_rtt_cv: float = 0.25
  net_gbps: float = 150.0           # assumed: 200 Gb/s NIC, mostly busy
  net_cv: float = 0.03
  bias: float = 0.01


CALIBRATION = Calibration()


@dataclasses.dataclass(frozen=True)
class Fault:
  """One labelled fault: which kind, on which machine, from `onset` to `end` (seconds)."""
  kind: str
  machine: int
  onset: int          # second the fault starts to show
  end: int            # second it stops (the machine was replaced, or the job restarted)
  severity: float


@dataclasses.dataclass
class Trace:
  """A generated fleet trace: the metric arrays a detector sees, and the labels it does not."""
  metrics: dict       # {metric: float32 [machines, seconds]}: all a detector sees
  faults: list        # [Fault]: the labels, for the scorer only
  blips: list         # [(machine, metric, start, seconds)]: healthy jitter
  machines: int
  seconds: int


def _schedule(rng, seconds, gap_s, fault_s, kinds, machines):
  faults, t = [], int(rng.uniform(*gap_s))
  while True:
    kind = str(rng.choice(kinds))
    length = int(rng.uniform(*fault_s)) if kind != "hang" else int(rng.uniform(120, 300))
    if t + length >= seconds:
      return faults
    lo, hi = {"slow_compute": (0.15, 0.6), "nic_degraded": (0.3, 0.7),
              "pcie_downgrade": (2.0, 4.0), "mem_pressure": (0.2, 0.6), "hang": (1, 1)}[kind]
    faults.append(Fault(kind, int(rng.integers(machines)), t, t + length,
                        float(rng.uniform(lo, hi))))
    t += length + int(rng.uniform(*gap_s))


def generate(machines: int, seconds: int, *, seed: int, faults: bool = True,
             gap_s=(600, 1800), fault_s=(180, 600), kinds=FAULT_KINDS,
             blips_per_machine_hour: float = 2.0, checkpoint_every_s: int = 1800,
             cal: Calibration = CALIBRATION) -> Trace:
  """One labelled trace. Faults never overlap; between them the fleet is healthy (with jitter).

  Args:
    machines, seconds: fleet size and simulated duration (one sample per second).
    seed: everything random comes from it.
    faults: False for a healthy-only trace (training data for the models).
    gap_s, fault_s: uniform ranges of healthy gaps between faults and of fault durations
      (hangs last 2 to 5 minutes: a job's hang timeout).
  """
  rng = np.random.default_rng(seed)
  M, T = machines, seconds
  t = np.arange(T)

  def noisy(level, cv, shape=(M, T)):
    bias = 1.0 + cal.bias * rng.standard_normal((M, 1))
    return level * bias * (1.0 + cv * rng.standard_normal(shape))

  wave = 1.0 + 0.02 * np.sin(2 * np.pi * t / 900.0 + rng.uniform(0, 6.3))  # the job's rhythm
  stall = np.zeros(T)                          # fleet-wide checkpoint stalls (healthy)
  for start in range(checkpoint_every_s, T, checkpoint_every_s):
    stall[start:start + 20] = 1.0
  s = cal.step_s
  compute = noisy(s * cal.compute_frac, cal.compute_cv) * wave
  data_wait = np.abs(noisy(s * cal.data_wait_frac, cal.data_wait_cv)) * (1 + 4 * stall)
  h2d = np.abs(noisy(s * cal.h2d_frac, cal.h2d_cv)) * (1 + 4 * stall)
  comm = s * cal.comm_frac * (1.0 + cal.comm_cv * rng.standard_normal(T))
  cpu = noisy(cal.cpu_pct, cal.cpu_cv) * (1 - 0.3 * stall)
  rss = noisy(cal.rss_gb, cal.rss_cv) * (1 + 0.05 * stall)
  rtt = np.abs(noisy(cal.hb_rtt_ms, cal.hb_rtt_cv))
  net = noisy(cal.net_gbps, cal.net_cv) * (1 - 0.9 * stall) * wave
  frozen = np.zeros(T, bool)                   # seconds in which the job is hung

  labels = _schedule(rng, T, gap_s, fault_s, kinds, M) if faults else []
  for f in labels:
    k, sl, n = f.machine, slice(f.onset, f.end), f.end - f.onset
    if f.kind == "slow_compute":
      compute[k, sl] *= 1.0 + f.severity
    elif f.kind == "nic_degraded":
      net[k, sl] *= 1.0 - f.severity
      comm[sl] *= 1.0 + f.severity
      rtt[k, sl] *= 1.0 + 0.5 * f.severity
    elif f.kind == "pcie_downgrade":
      h2d[k, sl] *= f.severity
      net[k, sl] *= rng.uniform(0.7, 0.9)
    elif f.kind == "mem_pressure":
      rss[k, sl] *= 1.0 + f.severity * np.linspace(0.1, 1.0, n)
      cpu[k, sl] += 100 * rng.uniform(0.1, 0.3)
      data_wait[k, sl] *= rng.uniform(1.5, 3.0)
    elif f.kind == "hang":
      frozen[sl] = True
      cpu[k, sl] = np.abs(2.0 + rng.standard_normal(n))
      net[:, sl] = np.abs(0.01 * cal.net_gbps * rng.standard_normal((M, n)))

  blips = []
  for _ in range(rng.poisson(blips_per_machine_hour * M * T / 3600.0)):
    i, metric = int(rng.integers(M)), str(rng.choice(_BLIP_METRICS))
    start, length = int(rng.integers(T)), int(rng.integers(1, 16))
    factor = rng.uniform(1.5, 3.0)
    target = {"compute_s": compute, "data_wait_s": data_wait, "host_to_device_s": h2d,
              "cpu_pct": cpu, "rss_gb": rss, "hb_rtt_ms": rtt, "net_gbps": net}[metric]
    target[i, start:start + length] *= factor if metric != "net_gbps" else 1 / factor
    blips.append((i, metric, start, length))

  own = compute + data_wait + h2d
  step = own.max(axis=0) + comm
  sync = step[None, :] - own
  step = np.broadcast_to(step, (M, T)) * (1.0 + 0.002 * rng.standard_normal((M, T)))
  out = {"step_s": step, "compute_s": compute, "sync_s": sync, "data_wait_s": data_wait,
         "host_to_device_s": h2d}
  for arr in out.values():                      # no step completes while hung: values freeze
    for run_start, run_end in _runs(frozen):
      arr[:, run_start:run_end] = arr[:, [max(run_start - 1, 0)]]
  out.update(cpu_pct=cpu, rss_gb=rss, hb_rtt_ms=rtt, net_gbps=net)
  metrics = {m: np.ascontiguousarray(out[m], dtype=np.float32) for m in METRICS}
  return Trace(metrics, labels, blips, M, T)


def _runs(mask: np.ndarray):
  """(start, end) of each run of True in a 1-D boolean mask."""
  edges = np.diff(np.concatenate([[0], mask.astype(int), [0]]))
  return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))
