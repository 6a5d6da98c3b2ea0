"""A prepared folder, as `experiments/prepare_data.py` writes it and the trainer reads it.

    DIR/manifest.json    what is here: sources, counts, tokenizer, dtype, splits, checksums
    DIR/tokenizer.json   the HF tokenizer (byte-level BPE), with the end-of-document token
    DIR/train.bin        training documents' tokens, each document followed by the EOD token
    DIR/heldout.bin      held-out documents' tokens, the same way

Token files are flat arrays of `token_dtype` (uint16 or uint32), memory-mapped for training.
The manifest is written last, so a folder without one was never finished. Every file the
manifest lists is checked against its size and SHA-256 before a run uses it.
"""
import hashlib
import json
import logging
import os
import time

import numpy as np

from mscale_jax.errors import ConfigError

MANIFEST_FILE = "manifest.json"
FORMAT = "mscale_jax.prepared/1"
SPLITS = ("train", "heldout")
TOKEN_DTYPES = {"uint16": 1 << 16, "uint32": 1 << 32}   # dtype -> how many ids it holds
_CHUNK = 8 << 20

log = logging.getLogger("mscale_jax")


def sha256_file(path: str) -> str:
  """Hex SHA-256 of a file, read in chunks."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      digest.update(chunk)
  return digest.hexdigest()


def read_manifest(folder: str, *, field: str = "data.path") -> dict:
  """The manifest of a prepared folder (not yet checked against the files).

  Raises:
    ConfigError: no such folder, no manifest there, or not one this code wrote.
  """
  if not folder or not os.path.isdir(folder):
    raise ConfigError(field, folder, "a folder written by experiments/prepare_data.py")
  path = os.path.join(folder, MANIFEST_FILE)
  if not os.path.isfile(path):
    raise ConfigError(field, folder, f"a folder written by experiments/prepare_data.py (it "
                      f"has no {MANIFEST_FILE}: the prepare step did not finish there)")
  try:
    with open(path, encoding="utf-8") as f:
      manifest = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(field, folder, f"a readable {MANIFEST_FILE} ({e})") from None
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
    raise ConfigError(field, folder, f"a {MANIFEST_FILE} of format {FORMAT!r}")
  return manifest


def files_of(manifest: dict) -> dict[str, dict]:
  """{file name: its entry (with 'sha256' and 'bytes')} for every file the manifest lists."""
  entries = [manifest["splits"][s] for s in SPLITS] + [manifest["tokenizer"]]
  return {e["file"]: e for e in entries}


def verify(folder: str, manifest: dict, *, field: str = "data.path") -> None:
  """Checks every listed file's size and SHA-256 against the manifest.

  Raises:
    ConfigError: a file is missing, or its size or checksum differs (naming which).
  """
  start, total = time.perf_counter(), 0
  for name, entry in files_of(manifest).items():
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
      raise ConfigError(field, folder, f"a prepared folder with every file its manifest lists "
                        f"({name} is missing)")
    size = os.path.getsize(path)
    if size != entry["bytes"]:
      raise ConfigError(field, folder, f"files that match the manifest: {name} has {size:,} "
                        f"bytes, the manifest says {entry['bytes']:,} (re-run the prepare step)")
    actual = sha256_file(path)
    if actual != entry["sha256"]:
      raise ConfigError(field, folder, f"files that match the manifest: the SHA-256 of {name} "
                        f"is {actual[:16]}..., the manifest says {entry['sha256'][:16]}... "
                        f"(re-run the prepare step)")
    total += size
  log.info("checked %.1f MB in %s against its manifest in %.1f s", total / 1e6, folder,
           time.perf_counter() - start)


def load(folder: str, vocab_size: int) -> tuple[dict, np.ndarray, np.ndarray]:
  """(manifest, train tokens, held-out tokens) of a checked prepared folder; memory-mapped.

  Raises:
    ConfigError: see `read_manifest` and `verify`; or `vocab_size` (the model's) is smaller
      than the tokenizer's vocabulary.
  """
  manifest = read_manifest(folder)
  vocab = manifest["vocab_size"]
  if vocab_size < vocab:
    raise ConfigError("model.vocab_size", vocab_size,
                      f"at least {vocab:,}, the vocabulary of the tokenizer in {folder} "
                      f"(--config.model.vocab_size={vocab} or larger)")
  verify(folder, manifest)
  dtype = np.dtype(manifest["token_dtype"])
  splits = []
  for split in SPLITS:
    entry = manifest["splits"][split]
    splits.append(np.memmap(os.path.join(folder, entry["file"]), dtype=dtype, mode="r",
                            shape=(entry["tokens"],)))
  return manifest, splits[0], splits[1]


def describe(folder: str, manifest: dict) -> str:
  """One line: where the corpus is, how large, which tokenizer, the held-out documents."""
  train, heldout = (manifest["splits"][s] for s in SPLITS)
  return (f"prepared: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens "
          f"({manifest['token_dtype']}, vocabulary {manifest['vocab_size']:,}) from {folder}; "
          f"held out {heldout['documents']:,} documents ({heldout['tokens']:,} tokens), "
          f"training on {train['documents']:,}")
