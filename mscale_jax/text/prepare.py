"""The prepare step: documents -> byte-level BPE tokenizer -> train / held-out token files.

    inputs --sources--> documents --hash of (seed, bytes)--> train | held out
    train documents (the first `tokenizer_bytes` of them) --> BPE training, or a given
        tokenizer.json
    every document --encode, all cores--> its ids + EOD --> train.bin | heldout.bin
    then tokenizer.json and, last, manifest.json (see `prepared.py` for the folder)

Held-out documents are whole documents chosen by a keyed hash: a document is held out iff
blake2b(its UTF-8 bytes, key=seed) < heldout_fraction * 2^64. So the choice looks random,
depends on the seed and the text only (not on the order or the other documents), and identical
documents always land on the same side. The tokenizer learns from training documents only.

Memory stays bounded: documents stream from the sources in batches of about `batch_bytes`,
each batch is encoded in parallel by the tokenizer's thread pool while the next is read, and
its tokens go straight to the files. The same inputs, options and seed give byte-identical
files and manifest.
"""
import concurrent.futures
import dataclasses
import hashlib
import itertools
import os
import time

import numpy as np
from tqdm import tqdm

from mscale_jax.errors import ConfigError
from mscale_jax.files import write_json
from mscale_jax.text import prepared, sources
from mscale_jax.text.tokenizer import (EOD_TOKEN, TOKENIZER_FILE, BPETokenizer,
                                       check_bpe_vocab, train_bpe)

_HASH_RANGE = 1 << 64


@dataclasses.dataclass(frozen=True)
class PrepareOptions:
  """The prepare step's settings (the command-line flags of the same names)."""
  vocab_size: int | None = None      # train a BPE tokenizer of this size ...
  tokenizer: str | None = None       # ... or use this tokenizer.json
  eod_token: str = EOD_TOKEN
  heldout_fraction: float = 0.01
  seed: int = 0
  token_dtype: str = "auto"          # auto: uint16 if the vocabulary fits, else uint32
  tokenizer_bytes: int = 1 << 30     # text the tokenizer learns from (the first training docs)
  batch_bytes: int = 4 << 20         # text encoded per batch
  overwrite: bool = False


@dataclasses.dataclass
class PrepareResult:
  """The manifest written, and how long each phase took (seconds; not in the manifest)."""
  manifest: dict
  tokenizer_s: float
  encode_s: float
  total_s: float


def prepare(inputs: list[str], out: str, options: PrepareOptions,
            read: sources.ReadOptions = sources.ReadOptions(), *,
            show_progress: bool = True) -> PrepareResult:
  """Reads `inputs`, trains (or loads) the tokenizer, writes `out`/{train,heldout}.bin,
  tokenizer.json and manifest.json.

  Raises:
    ConfigError: a bad option, a missing input, an empty corpus, a vocabulary the token dtype
      cannot hold, text that is not UTF-8 under on_invalid_utf8='fail', an existing prepared
      folder without `overwrite`, or a split left with no documents.
  """
  start = time.perf_counter()
  _check_options(options)
  found = sources.find_inputs(inputs, read, skip=out)
  _claim_folder(out, options.overwrite)
  tokenizer = _tokenizer(found, read, options, show_progress)
  tokenizer_s = time.perf_counter() - start
  dtype = _token_dtype(options.token_dtype, tokenizer.vocab_size)
  stats = [source.stats() for source in found]
  writers = {split: _SplitWriter(os.path.join(out, f"{split}.bin"), dtype)
             for split in prepared.SPLITS}
  try:
    encode_start = time.perf_counter()
    _encode(sources.documents(found, read, stats), tokenizer, writers, options, show_progress)
    encode_s = time.perf_counter() - encode_start
    _check_splits(writers, stats, options)
    splits = {split: writer.finish() for split, writer in writers.items()}
  finally:
    for writer in writers.values():
      writer.abort()
  tokenizer_path = os.path.join(out, TOKENIZER_FILE)
  tokenizer.save(tokenizer_path)
  manifest = _manifest(tokenizer, tokenizer_path, dtype, splits, stats, options, read)
  write_json(os.path.join(out, prepared.MANIFEST_FILE), manifest, indent=2)
  return PrepareResult(manifest, tokenizer_s, encode_s, time.perf_counter() - start)


def _check_options(o: PrepareOptions) -> None:
  if (o.vocab_size is None) == (o.tokenizer is None):
    raise ConfigError("--vocab_size", o.vocab_size, "a vocabulary size to train a tokenizer "
                      "with, or none with --tokenizer=tokenizer.json (exactly one of the two)")
  if o.vocab_size is not None:
    check_bpe_vocab(o.vocab_size)
  if o.token_dtype not in ("auto", *prepared.TOKEN_DTYPES):
    raise ConfigError("--token_dtype", o.token_dtype,
                      f"one of auto, {', '.join(prepared.TOKEN_DTYPES)}")
  if o.vocab_size is not None and o.token_dtype != "auto":
    _token_dtype(o.token_dtype, o.vocab_size)            # fail before reading anything
  if not 0.0 < o.heldout_fraction < 1.0:
    raise ConfigError("--heldout_fraction", o.heldout_fraction, "a fraction in (0, 1)")
  if isinstance(o.seed, bool) or not isinstance(o.seed, int) or not 0 <= o.seed < 1 << 64:
    raise ConfigError("--seed", o.seed, "an integer in [0, 2^64)")
  for field in ("tokenizer_bytes", "batch_bytes"):
    value = getattr(o, field)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ConfigError(f"--{field}", value, "a positive number of bytes")


def _token_dtype(requested: str, vocab_size: int) -> str:
  """The token dtype: the smallest that holds `vocab_size` ids, or the requested one."""
  if requested == "auto":
    return next(d for d, size in prepared.TOKEN_DTYPES.items() if vocab_size <= size)
  if vocab_size > prepared.TOKEN_DTYPES[requested]:
    raise ConfigError("--token_dtype", requested, f"a dtype that holds {vocab_size:,} token ids "
                      f"({requested} holds {prepared.TOKEN_DTYPES[requested]:,}); use uint32 "
                      f"or auto")
  return requested


def _claim_folder(out: str, overwrite: bool) -> None:
  """Creates `out`; refuses a prepared folder unless `overwrite` (then unmarks it first)."""
  if not out:
    raise ConfigError("--out", out, "a folder to write the prepared data to")
  manifest = os.path.join(out, prepared.MANIFEST_FILE)
  if os.path.exists(manifest):
    if not overwrite:
      raise ConfigError("--out", out, "a folder without prepared data, or --overwrite to "
                        "replace the data there")
    os.remove(manifest)        # a half-replaced folder must not pass for a prepared one
  if os.path.exists(out) and not os.path.isdir(out):
    raise ConfigError("--out", out, "a folder (this is a file)")
  os.makedirs(out, exist_ok=True)


def held_out(data: bytes, seed_key: bytes, threshold: int) -> bool:
  """Whether the document with UTF-8 bytes `data` is held out (see the module docstring)."""
  digest = hashlib.blake2b(data, digest_size=8, key=seed_key).digest()
  return int.from_bytes(digest, "little") < threshold


def _split_rule(options: PrepareOptions) -> tuple[bytes, int]:
  return options.seed.to_bytes(8, "little"), int(options.heldout_fraction * _HASH_RANGE)


def _tokenizer(found, read, options: PrepareOptions, show_progress: bool) -> BPETokenizer:
  """The given tokenizer, or byte-level BPE trained on the first training documents."""
  if options.tokenizer is not None:
    return BPETokenizer.from_file(options.tokenizer, options.eod_token)
  stats = [source.stats() for source in found]
  key, threshold = _split_rule(options)
  taken = 0

  def training_texts(bar):
    nonlocal taken
    for text, data in sources.documents(found, read, stats):
      if held_out(data, key, threshold):
        continue
      bar.update(1)
      taken += len(data)
      yield text
      if taken >= options.tokenizer_bytes:
        return

  # A bar closes before any error is printed, so the error stays one line of its own.
  with tqdm(desc="tokenizer: read", unit="doc", disable=not show_progress,
            dynamic_ncols=True) as bar:
    tokenizer = train_bpe(training_texts(bar), options.vocab_size, show_progress=show_progress)
  if taken == 0:
    raise _empty_corpus(stats)
  return tokenizer


def _empty_corpus(stats) -> ConfigError:
  skipped = sum(s.skipped_invalid_utf8 for s in stats)
  empty = sum(s.skipped_empty for s in stats)
  return ConfigError("--input", [s.path for s in stats],
                     f"a corpus with at least one training document; found none (skipped "
                     f"{empty} empty and {skipped} non-UTF-8 documents)")


def _batches(documents, batch_bytes: int):
  """Lists of (text, bytes) documents of about `batch_bytes` text each."""
  batch, size = [], 0
  for document in documents:
    batch.append(document)
    size += len(document[1])
    if size >= batch_bytes:
      yield batch
      batch, size = [], 0
  if batch:
    yield batch


def _encode(documents, tokenizer: BPETokenizer, writers, options: PrepareOptions,
            show_progress: bool) -> None:
  """Encodes every document and appends its ids + EOD to its split's file, in order.

  One thread reads the next batch (file I/O, UTF-8 decoding, hashing) while the tokenizer's
  own threads encode this one, so reading hides behind encoding.
  """
  key, threshold = _split_rule(options)
  dtype, eod = writers["train"].dtype, tokenizer.eod
  start, tokens, text_bytes = time.perf_counter(), 0, 0
  batches = _batches(documents, options.batch_bytes)
  with tqdm(desc="encode", unit="doc", disable=not show_progress, dynamic_ncols=True) as bar, \
      concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="read") as reader:
    pending = reader.submit(next, batches, None)
    while (batch := pending.result()) is not None:
      pending = reader.submit(next, batches, None)
      ids = tokenizer.encode_batch([text for text, _ in batch])
      sides = [held_out(data, key, threshold) for _, data in batch]
      for split, side in (("train", False), ("heldout", True)):
        chosen = [(i, len(data)) for i, s, (_, data) in zip(ids, sides, batch) if s == side]
        if not chosen:
          continue
        count = sum(len(i) + 1 for i, _ in chosen)
        flat = np.fromiter(itertools.chain.from_iterable(i + [eod] for i, _ in chosen),
                           dtype=dtype, count=count)
        writers[split].add(flat, len(chosen), sum(n for _, n in chosen))
        tokens += count
      text_bytes += sum(len(data) for _, data in batch)
      bar.update(len(batch))
      seconds = max(time.perf_counter() - start, 1e-9)
      bar.set_postfix_str(f"{tokens / seconds:,.0f} tok/s, {text_bytes / seconds / 1e6:.2f} MB/s",
                          refresh=False)


def _check_splits(writers, stats, options: PrepareOptions) -> None:
  documents = sum(w.documents for w in writers.values())
  if documents == 0:
    raise _empty_corpus(stats)
  for split, other in (("heldout", "train"), ("train", "heldout")):
    if writers[split].documents == 0:
      raise ConfigError("--heldout_fraction", options.heldout_fraction,
                        f"a fraction that leaves documents on both sides: all {documents} went "
                        f"to {other} (a small corpus needs a larger fraction, or another "
                        f"--seed)")


class _SplitWriter:
  """Appends tokens to `path` (via a temporary file), counting and hashing as it goes."""

  def __init__(self, path: str, dtype: str):
    self.path, self.dtype = path, dtype
    self._tmp = path + ".tmp"
    self._file = open(self._tmp, "wb")
    self._sha = hashlib.sha256()
    self.documents = self.tokens = self.text_bytes = 0

  def add(self, tokens: np.ndarray, documents: int, text_bytes: int) -> None:
    data = tokens.tobytes()
    self._file.write(data)
    self._sha.update(data)
    self.tokens += tokens.size
    self.documents += documents
    self.text_bytes += text_bytes

  def finish(self) -> dict:
    """Closes the file under its final name; its manifest entry."""
    self._file.close()
    os.replace(self._tmp, self.path)
    size = self.tokens * np.dtype(self.dtype).itemsize
    return {"file": os.path.basename(self.path), "documents": self.documents,
            "tokens": self.tokens, "text_bytes": self.text_bytes, "bytes": size,
            "sha256": self._sha.hexdigest()}

  def abort(self) -> None:
    """Removes the temporary file if `finish` did not run."""
    self._file.close()
    if os.path.exists(self._tmp):
      os.remove(self._tmp)


def _manifest(tokenizer: BPETokenizer, tokenizer_path: str, dtype: str, splits: dict,
              stats, options: PrepareOptions, read: sources.ReadOptions) -> dict:
  train, heldout = splits["train"], splits["heldout"]
  return {
      "format": prepared.FORMAT,
      "documents": train["documents"] + heldout["documents"],
      "tokens": train["tokens"] + heldout["tokens"],
      "text_bytes": train["text_bytes"] + heldout["text_bytes"],
      "vocab_size": tokenizer.vocab_size,
      "token_dtype": dtype,
      "eod_token": tokenizer.eod_token,
      "eod_id": tokenizer.eod,
      "tokenizer": {
          "file": TOKENIZER_FILE,
          "bytes": os.path.getsize(tokenizer_path),
          "sha256": prepared.sha256_file(tokenizer_path),
          "source": (f"given: {os.path.abspath(options.tokenizer)}" if options.tokenizer
                     else f"byte-level BPE trained here on the first {options.tokenizer_bytes:,}"
                          f" bytes of training documents (vocab_size={options.vocab_size})"),
      },
      "splits": splits,
      "heldout": {"fraction": options.heldout_fraction, "seed": options.seed,
                  "rule": "whole documents: blake2b(UTF-8 bytes, digest 8, key=seed as 8 "
                          "little-endian bytes) read little-endian < fraction * 2^64"},
      "layout": "each document's tokens followed by the end-of-document token",
      "sources": [dataclasses.asdict(s) for s in stats],
      "skipped": {"invalid_utf8": sum(s.skipped_invalid_utf8 for s in stats),
                  "empty": sum(s.skipped_empty for s in stats)},
      "read_options": {**dataclasses.asdict(read), "exclude": list(read.exclude)},
  }
