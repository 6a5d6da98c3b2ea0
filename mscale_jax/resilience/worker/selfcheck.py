"""Self-check diagnostics, run by a restarted worker group before it trains (MegaScale §4.3).

Scaled to what one machine can show, every process of the group (one per slot, already joined
with `jax.distributed`) runs:

  matmul     the local matmul rate (GFLOP/s, float32) of its first device, compared with the
             group's median (processes take turns, so that processes sharing a host do not
             slow each other's probe)
  allgather  every process contributes a block derived from its rank; after the collective each
             checks every block (correctness: names a slot whose contribution arrives corrupt)
             and times a larger all-gather (bandwidth, GB/s received per process)
  write      writes, fsyncs, reads back and removes a file in the checkpoint directory

The results are all-gathered, so every process reaches the same verdict (`judge`) without a
round trip to the driver. They run inside the restarted group rather than in a separate job:
on this machine that separate job cost as much as the restart itself. MSCALE_SELF_CHECK=1 asks
a worker to run them (`self_check_if_asked`); on a bad slot (the `bad_slot` fault, faults.py)
what the all-gather delivers to the process arrives corrupt, as training's results do there.
"""
import json
import logging
import os
import statistics
import sys
import time

from mscale_jax import compile_cache
from mscale_jax.files import write_json
from mscale_jax.resilience import events
from mscale_jax.resilience.worker.faults import corrupt_received, slot_is_bad

log = logging.getLogger("mscale_jax")

# A slot whose matmul rate is below this fraction of the median fails.
MIN_RATE_FRACTION = 0.5
# A slot found slow is probed again, longer, before it fails (CONFIRM_REPEATS runs; its rate is
# the better of the two rounds): a busy host can starve one process for the whole first
# probe (a drill at load 20 on 2 cores excluded a healthy slot at 24 GFLOP/s against 96),
# while a slow device is slow in every run.
CONFIRM_REPEATS = 50


def probe_matmul(size: int = 384, repeats: int = 10) -> float:
  """GFLOP/s of a float32 [size, size] matmul on this process's first device.

  The best of `repeats` runs: a busy neighbour makes single runs slow now and then, a slow
  device makes every run slow.
  """
  import jax
  import numpy as np
  # Made on the host: eager jnp ops would compile three more small programs per restart.
  x = jax.device_put(np.full((size, size), 1.0 / size, np.float32), jax.local_devices()[0])
  matmul = jax.jit(lambda a: a @ a)
  matmul(x).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(x).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * size ** 3 / min(times) / 1e9


def probe_allgather(corrupt: bool, bandwidth_bytes: int = 1 << 22) -> dict:
  """Correctness (ranks whose block arrived wrong here) and bandwidth of a cross-process
  all-gather; `corrupt`: this process is on a bad slot (what it receives arrives corrupt)."""
  import numpy as np
  import jax
  rank, count = jax.process_index(), jax.process_count()
  expected = lambda r: np.arange(1024, dtype=np.float32) * (r + 1) + r   # noqa: E731
  gathered = process_allgather(expected(rank))
  gathered = np.asarray(corrupt_received(gathered) if corrupt else gathered)
  wrong = [r for r in range(count) if not np.array_equal(gathered[r], expected(r))]
  big = np.full(bandwidth_bytes // 4, rank, np.float32)
  process_allgather(big)   # warm-up (loads or compiles; connects the collective)
  start = time.perf_counter()
  process_allgather(big)
  seconds = time.perf_counter() - start
  return {"wrong_ranks": wrong, "gbytes_per_s": bandwidth_bytes * count / seconds / 1e9}


def process_allgather(block):
  """[process_count, *block.shape]: every process's numpy `block`, by one cross-process
  all-gather on all devices (the program `jax.experimental.multihost_utils.process_allgather`
  runs), served by this process's compile cache where one is configured (compile_cache.py:
  JAX's own serves process 0 only, so every other process compiled each probe per restart)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  block = np.asarray(block)[None]
  devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
  mesh = jax.sharding.Mesh(devices, ("processes", "local_devices"))
  x = jax.make_array_from_single_device_arrays(
      (jax.process_count(),) + block.shape[1:], NamedSharding(mesh, P("processes")),
      [jax.device_put(block, d) for d in jax.local_devices()])
  key = (block.shape, block.dtype.str, tuple(d.id for d in devices.flat))
  if key not in _GATHERS:
    def selfcheck_allgather(a):   # replicated output: XLA all-gathers the processes' blocks
      return a
    gather = jax.jit(selfcheck_allgather, out_shardings=NamedSharding(mesh, P()))
    _GATHERS[key], _ = compile_cache.load_or_lower(gather.lower, (x,), "selfcheck_allgather",
                                                   mesh, "self-check all-gather")
  return np.asarray(_GATHERS[key](x).addressable_data(0))


_GATHERS = {}   # (block shape, dtype, devices) -> the all-gather program, once per process


def barrier(name: str) -> None:
  """Returns once every process has reached the barrier `name` (an all-gather of the name);
  AssertionError if another process is at another barrier."""
  import numpy as np
  names = process_allgather(_padded(name.encode()))
  if not (names == names[0]).all():
    raise AssertionError(f"self-check barrier {name!r}: the processes are at different ones")


def _padded(raw: bytes):
  """`raw` zero-padded to _RESULT_BYTES uint8 (one program shape for barriers and results)."""
  import numpy as np
  encoded = np.zeros(_RESULT_BYTES, np.uint8)
  raw = raw[:_RESULT_BYTES]
  encoded[:len(raw)] = np.frombuffer(raw, np.uint8)
  return encoded


def probe_write(directory: str, size: int = 1 << 22) -> dict:
  """Writes, fsyncs, reads back and removes a file under `directory`: {'ok', 'mbytes_per_s'}."""
  path = os.path.join(directory, f".selfcheck-{os.getpid()}")
  data = os.urandom(size)
  try:
    os.makedirs(directory, exist_ok=True)
    start = time.perf_counter()
    with open(path, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    with open(path, "rb") as f:
      ok = f.read() == data
    os.remove(path)
    return {"ok": ok, "mbytes_per_s": size / seconds / 1e6}
  except OSError as e:
    return {"ok": False, "error": str(e)}


def judge(results: dict[int, dict | None]) -> dict[int, str | None]:
  """{slot: None if healthy, else why it fails} from each slot's probe results (None: no result).

  A slot fails if it produced no result (crashed or hung), its matmul rate is below
  MIN_RATE_FRACTION of the median, every slot saw its all-gather block arrive corrupt (it sends
  wrong data), it saw a block corrupt that another slot received intact (what it receives is
  wrong), or its checkpoint-directory write failed.
  """
  done = {s: r for s, r in results.items() if r is not None}
  median, slow = _median_rate(done), slow_slots(results)
  slot_of_rank = {r["rank"]: s for s, r in done.items()}
  seen_wrong = {s: set(r["allgather"]["wrong_ranks"]) for s, r in done.items()}
  senders = {slot_of_rank.get(w) for w in set.intersection(*seen_wrong.values())} \
      if seen_wrong else set()
  receivers = {s for s, wrong in seen_wrong.items()
               if any(w not in other for w in wrong for o, other in seen_wrong.items() if o != s)}
  verdict = {}
  for slot, r in results.items():
    if r is None:
      verdict[slot] = "no self-check result (the process crashed or hung)"
    elif slot in senders:
      verdict[slot] = "its all-gather contribution arrived corrupt"
    elif slot in receivers:
      verdict[slot] = "the all-gather results it received were corrupt"
    elif slot in slow:
      verdict[slot] = (f"matmul rate {r['matmul_gflops']:.1f} GFLOP/s is below "
                       f"{MIN_RATE_FRACTION:.0%} of the median {median:.1f}")
    elif not r["write"]["ok"]:
      verdict[slot] = f"checkpoint directory write failed: {r['write'].get('error', 'mismatch')}"
    else:
      verdict[slot] = None
  return verdict


def _median_rate(done: dict) -> float:
  rates = [r["matmul_gflops"] for r in done.values()]
  return statistics.median(rates) if rates else 0.0


def slow_slots(results: dict[int, dict | None]) -> set[int]:
  """Slots whose matmul rate is below MIN_RATE_FRACTION of the group's median."""
  done = {s: r for s, r in results.items() if r is not None}
  median = _median_rate(done)
  return {s for s, r in done.items() if r["matmul_gflops"] < MIN_RATE_FRACTION * median}


def with_second_rates(results: dict[int, dict | None], again: dict[int, float]) -> dict:
  """`results` with each slot's matmul rate the better of its first probe and `again`'s
  ({slot: GFLOP/s}); the first is kept as `matmul_gflops_first`."""
  out = {}
  for s, r in results.items():
    if r is not None and s in again:
      r = {**r, "matmul_gflops_first": r["matmul_gflops"],
           "matmul_gflops": max(r["matmul_gflops"], again[s])}
    out[s] = r
  return out


def _matmul_in_turns(tag: str, repeats: int) -> float:
  """This process's matmul rate, each process probing in its turn (so that processes sharing
  a host do not slow each other's probe)."""
  import jax
  rate = None
  for rank in range(jax.process_count()):
    if rank == jax.process_index():
      rate = probe_matmul(repeats=repeats)
    barrier(f"selfcheck {tag} {rank}")
  return rate


def share(mine: dict) -> list[dict]:
  """Every process's `mine` (JSON-able, <= 4 KiB), in rank order, by one all-gather."""
  return [json.loads(row.tobytes().rstrip(b"\0"))
          for row in process_allgather(_padded(json.dumps(mine).encode()))]


def run_in_group(out_dir: str, checkpoint_dir: str, *, slot: int, corrupt: bool = False):
  """Runs every probe on this process, shares the results, judges them.

  Returns (verdict {slot: None or why it fails}, results {slot: probe results}). Every process
  writes OUT_DIR/slot<slot>.json; process 0 also writes OUT_DIR/verdict.json. Call it on every
  process of the group, after `jax.distributed` is initialised.
  """
  import jax
  start = time.perf_counter()
  mine = {"slot": slot, "rank": jax.process_index(),
          "matmul_gflops": _matmul_in_turns("matmul", repeats=10),
          "allgather": probe_allgather(corrupt), "write": probe_write(checkpoint_dir)}
  results = {r["slot"]: r for r in share(mine)}
  if slow_slots(results):   # every process sees the same results, so all probe again together
    again = share({"slot": slot, "rate": _matmul_in_turns("matmul again", CONFIRM_REPEATS)})
    results = with_second_rates(results, {r["slot"]: r["rate"] for r in again})
  verdict = judge(results)
  write_json(os.path.join(out_dir, f"slot{slot}.json"), mine)
  if jax.process_index() == 0:
    write_json(os.path.join(out_dir, "verdict.json"), {
        "seconds": time.perf_counter() - start, "results": results,
        "excluded": {s: why for s, why in verdict.items() if why}})
  return verdict, results


_RESULT_BYTES = 4096   # one process's results as JSON, zero-padded for the all-gather


def self_check_if_asked(heartbeats, workdir: str, env=None) -> None:
  """Runs the group's self-checks when MSCALE_SELF_CHECK=1; exits if any slot fails them.

  `heartbeats` is this worker's HeartbeatClient (the driver sees the phase 'self_check'). Every
  process reaches the same verdict; on a failing slot each reports a `self_check_failed`
  failure and exits with EXIT_SELF_CHECK_FAILED, and the driver restarts the group without
  that slot (WORKDIR/resilience/selfcheck-<attempt>/verdict.json says why).
  """
  env = os.environ if env is None else env
  if env.get("MSCALE_SELF_CHECK") != "1":
    return
  heartbeats.start()
  heartbeats.phase(events.SELF_CHECK)
  start = time.perf_counter()
  verdict, _ = run_in_group(
      os.path.join(workdir, "resilience", f"selfcheck-{env.get('MSCALE_ATTEMPT', '0')}"),
      os.path.join(workdir, "checkpoints"), slot=int(env.get("MSCALE_SLOT", "0")),
      corrupt=slot_is_bad(env, workdir))
  failed = {slot: why for slot, why in verdict.items() if why}
  if failed:
    detail = "; ".join(f"slot {slot}: {why}" for slot, why in sorted(failed.items()))
    log.error("self-check failed: %s", detail)
    heartbeats.failure(events.SELF_CHECK_FAILED, detail)
    sys.exit(events.EXIT_SELF_CHECK_FAILED)
  log.info("self-check passed on slots %s in %.1f s", sorted(verdict),
           time.perf_counter() - start)
