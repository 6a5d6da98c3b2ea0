"""One process of tests/test_refused_saves.py's two-process save (not a test itself): saves step
4, then step 8, whose commit process 0 refuses (the folder turns read-only from orbax's thread
just before the rename); then, writable again, step 8 again (as after a rollback); then step
12, whose background write fails on process 1 alone (the kernel refuses its files past a
per-process size limit); then a second
Checkpointer of the folder saves step 16. Prints what each process saw as JSON.

  MSCALE_COORDINATOR=host:port MSCALE_NUM_PROCESSES=2 MSCALE_PROCESS_ID=i \\
      python tests/refused_save_worker.py DIRECTORY
"""
import json
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mscale_jax.resilience.worker.distributed import initialize_distributed  # noqa: E402

initialize_distributed()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from mscale_jax.checkpoint import Checkpointer, CheckpointWriteError  # noqa: E402
from mscale_jax.config import Config  # noqa: E402
from mscale_jax.files import checkpoint_steps  # noqa: E402
from mscale_jax.resilience.driver import injector  # noqa: E402

directory = sys.argv[1]
import faulthandler  # noqa: E402
faulthandler.dump_traceback_later(float(os.environ.get("DUMP_AFTER", "1e9")), exit=True)
mesh = Mesh(np.array(jax.devices()), ("d",))


def state(step):   # 64 KiB of random floats: each process's part is far over FILE_LIMIT
  values = np.random.default_rng(step).normal(size=(256, 64)).astype(np.float32)
  return {"w": jax.make_array_from_callback(values.shape, NamedSharding(mesh, P("d")),
                                            lambda index: values[index])}


checkpointer = Checkpointer(directory, keep=3)
checkpointer.save(4, state(4), {"position": 4}, Config())
checkpointer.wait()
manifest = checkpointer._manifest


def manifest_then_refuse(step):   # process 0, orbax's thread, just before the commit's rename
  manifest(step)
  if step == 8:
    injector.make_read_only(directory)


def save_and_wait(step):
  """Saves `step` and waits for its write: the step of a save refused and dropped, or None."""
  checkpointer.save(step, state(step), {"position": step}, Config())
  try:
    checkpointer.wait()
  except CheckpointWriteError as error:
    checkpointer.discard(error.step)
    return error.step
  return None


checkpointer._manifest = manifest_then_refuse
refused = save_and_wait(8)
latest_after_refusal = checkpointer.latest_step()   # step 8 is in orbax's list on process 1
if jax.process_index() == 0:   # as the driver does once the refusal is reported
  injector.make_writable(directory)
ocp.multihost.get_jax_distributed_client().wait_at_barrier("writable again", 60_000)
checkpointer._manifest = manifest
checkpointer.save(8, state(8), {"position": 8}, Config())   # saved again, as after a rollback
checkpointer.wait()   # on disk before the limit below, which would refuse its last writes too
# Step 12: the kernel refuses process 1's writes past FILE_LIMIT bytes (a per-process file-size
# limit, as a full disk of its own would): the one-byte write probe passes, the arrays' data
# files do not (EFBIG; Python ignores SIGXFSZ), in orbax's background write.
FILE_LIMIT = 4096
unlimited = resource.getrlimit(resource.RLIMIT_FSIZE)
if jax.process_index() == 1:
  resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, unlimited[1]))
refused_too = save_and_wait(12)
resource.setrlimit(resource.RLIMIT_FSIZE, unlimited)
checkpointer.close()
# A second Checkpointer of the folder in this session names its own keys.
checkpointer = Checkpointer(directory, keep=3)
checkpointer.save(16, state(16), {"position": 16}, Config())
checkpointer.close()
print(json.dumps({"rank": jax.process_index(), "refused": [refused, refused_too],
                  "latest_after_refusal": latest_after_refusal,
                  "steps": checkpoint_steps(directory), "left": sorted(os.listdir(directory))}))
