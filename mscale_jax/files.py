"""Writing a file whole or not at all, for records other processes (or a restart) may read;
checksum manifests of a folder (checkpoints), to notice later that a file changed; the list of
complete checkpoints in a checkpoint folder; whether a folder takes a new file."""
import hashlib
import json
import os
import time

MANIFEST = "manifest.json"


def write_json(path: str, value, **dump_kwargs) -> None:
  """Writes `value` as JSON to `path` via a temporary file and a rename (creates the folder).

  A reader sees the old file or the new one, never half of one. `dump_kwargs` go to json.dump.
  """
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(value, f, **dump_kwargs)
  os.replace(path + ".tmp", path)


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def _files_under(directory: str, folders) -> list[str]:
  return sorted(rel for root, _, names in os.walk(directory) for name in names
                if (rel := os.path.relpath(os.path.join(root, name), directory)) != MANIFEST
                and (folders is None or rel.split(os.sep)[0] in folders))


def write_manifest(directory: str, folders=None) -> dict:
  """Writes DIRECTORY/manifest.json: the size and SHA-256 of every file below `directory`, or
  only of those in its subfolders named in `folders`."""
  files = {rel: {"bytes": os.path.getsize(os.path.join(directory, rel)),
                 "sha256": _sha256(os.path.join(directory, rel))}
           for rel in _files_under(directory, folders)}
  write_json(os.path.join(directory, MANIFEST), {"files": files}, indent=1)
  return files


def verify_manifest(directory: str) -> str | None:
  """None if every file `directory`'s manifest lists is there, unchanged (or there is no
  manifest: a folder written before manifests existed); otherwise what is wrong, in words."""
  path = os.path.join(directory, MANIFEST)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    files = json.load(f)["files"]
  for rel, want in files.items():
    full = os.path.join(directory, rel)
    if not os.path.exists(full):
      return f"{rel} is missing"
    if os.path.getsize(full) != want["bytes"]:
      return f"{rel} has {os.path.getsize(full)} bytes, {want['bytes']} were written"
    if _sha256(full) != want["sha256"]:
      return f"{rel} fails its SHA-256 checksum"
  return None


def can_write(directory: str) -> str:
  """'' if `directory` takes a new file, else why not (read-only, full, gone): a checkpoint
  save finds it at once rather than in orbax's background thread later."""
  probe = os.path.join(directory, f".write-probe-{os.getpid()}")
  problem = ""
  try:
    with open(probe, "wb") as f:
      f.write(b"0")
  except OSError as e:
    problem = f"{type(e).__name__}: {e}"
  try:   # also when made but not written (a full disk)
    os.remove(probe)
  except FileNotFoundError:
    pass
  except OSError as e:
    problem = problem or f"{type(e).__name__}: {e}"
  return problem


def checkpoint_steps(directory: str) -> list[int]:
  """The steps of the complete checkpoints in `directory`, newest first ([] if it is missing).

  A complete checkpoint is a folder named by its step: orbax writes into
  `STEP.orbax-checkpoint-tmp-*` and renames it when complete, so a half-written one is not
  listed. A corrupt one is (check each with `verify_manifest`).
  """
  if not os.path.isdir(directory):
    return []
  return sorted((int(d) for d in os.listdir(directory) if d.isdigit()), reverse=True)


def set_aside_corrupt(directory: str) -> list[dict]:
  """Moves checkpoints under `directory` that fail their manifest, newest first until one holds,
  into a sibling folder 'checkpoints_corrupt'; returns [{'step', 'problem', 'moved_to'}]."""
  moved = []
  for step in checkpoint_steps(directory):
    problem = verify_manifest(os.path.join(directory, str(step)))
    if problem is None:
      break
    target = os.path.join(os.path.dirname(directory), "checkpoints_corrupt",
                          f"{step}-{time.strftime('%Y%m%dT%H%M%S')}")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.replace(os.path.join(directory, str(step)), target)
    moved.append({"step": step, "problem": problem, "moved_to": target})
  return moved
