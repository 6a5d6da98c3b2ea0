"""Writing a file whole or not at all, for records other processes (or a restart) may read."""
import json
import os


def write_json(path: str, value, **dump_kwargs) -> None:
  """Writes `value` as JSON to `path` via a temporary file and a rename (creates the folder).

  A reader sees the old file or the new one, never half of one. `dump_kwargs` go to json.dump.
  """
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(value, f, **dump_kwargs)
  os.replace(path + ".tmp", path)
