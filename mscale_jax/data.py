"""Token corpora and grain input pipelines: one loader per host, prefetched, checkpointable.

Four corpus kinds (`DataConfig.kind`):
  stdlib     this machine's Python standard library source (offline, real text), byte tokens
             (vocab 256: token = byte value). Files are read in sorted relative-path order and
             each is followed by `SEPARATOR`. Held out: every Nth file by that order,
             N = round(1 / heldout_fraction), so whole files stay apart; the seed plays no part.
  tokens     a flat binary file of uint16/uint32 tokens, memory-mapped. Held out: the last
             heldout_fraction of the stream.
  synthetic  uniform random tokens from a generator with a fixed seed (`SYNTHETIC_SEED`), so
             the data and its held-out tail are the same for every `data.seed`.
  prepared   a folder written by `experiments/prepare_data.py` (`mscale_jax.text`): token files
             memory-mapped after their checksums are checked, the tokenizer's end-of-document
             token after every document; the held-out documents are the manifest's.

Training examples are non-overlapping windows of seq_len + 1 tokens on a fixed grid
(window k starts at token k * seq_len, so neighbouring windows share one boundary token and
every token is a target exactly once per epoch). grain shuffles the windows with a seed mixed
from `seed`, reshuffles each epoch (grain's shuffle uses seed + epoch), repeats forever and
batches `global_batch` windows per step. Each process keeps its own rows of every global batch
(process i of n: rows [i * local, (i + 1) * local)), so the union over processes is exactly the
global batch and the iterator state (the global step) is the same on every process.

With `data.document_mask` (corpora with document boundaries: stdlib, prepared) every batch also
holds 'segment_ids', int32 [b, seq_len]: the number of end-of-document tokens at or before each
input position within its window. A document's end-of-document token thus opens the next
segment, like a beginning-of-sequence token: the last token of a document still predicts the
end, and the model's attention (`segment_ids` in `mscale_jax.attention`) never crosses into
another document.
"""
import dataclasses
import hashlib
import logging
import os
import shutil
import sysconfig
import tempfile
import zipfile
from typing import Any, Iterator

import grain
import numpy as np

from mscale_jax.errors import ConfigError
from mscale_jax.files import write_json
from mscale_jax.text import prepared
from mscale_jax.text.tokenizer import TOKENIZER_FILE, ByteTokenizer

SEPARATOR = 0                  # byte token after every stdlib file (NUL never occurs in source)
SYNTHETIC_SEED = 0x5EED        # the synthetic corpus does not depend on data.seed
DEFAULT_MAX_BYTES = 32 << 20   # stdlib read cap; the whole 3.11 stdlib is about 31.5 MB
_SKIPPED_DIRS = ("site-packages", "dist-packages", "__pycache__")
_FULL_CHECK_TOKENS = 1 << 28   # token files up to this size get an exact max-token check
_STATE_VERSION = 1

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A tokenised corpus: 1-D `train` and `heldout` token arrays (memmaps for files).

  `eod` is the end-of-document token where the corpus has documents (None: a plain stream);
  `document_mask` asks the batches for segment ids; `folder` and `manifest` name a prepared
  corpus's source (recorded with a run, and checked when it resumes).
  """
  train: np.ndarray
  heldout: np.ndarray
  description: str
  kind: str = "stdlib"
  eod: int | None = None
  document_mask: bool = False
  folder: str | None = None
  manifest: dict | None = None

  @property
  def fingerprint(self) -> str | None:
    """The prepared corpus's identity (its training file's SHA-256), or None."""
    return self.manifest["splits"]["train"]["sha256"] if self.manifest else None


def load_corpus(config, vocab_size: int, *, max_bytes: int = DEFAULT_MAX_BYTES,
                synthetic_tokens: int = 1 << 20, cache_dir: str | None = None) -> Corpus:
  """Loads the corpus a `DataConfig` names and splits off its held-out part.

  Args:
    config: a `mscale_jax.config.DataConfig`.
    vocab_size: the model's vocabulary; every token must be below it.
    max_bytes: kind='stdlib' reads whole files in sorted order until this many bytes.
    synthetic_tokens: length of the kind='synthetic' stream (train + held-out).
    cache_dir: kind='stdlib' keeps its tokens here and reads them back while no file of the
      folder has changed (`_stdlib_key`), rather than reading ~1,800 files again (a
      restarted worker; the trainer passes one where a compile cache folder is configured).

  Raises:
    ConfigError: the path is missing or holds no usable tokens, or a token is >= vocab_size.
  """
  if not 0.0 < config.heldout_fraction < 1.0:
    raise ConfigError("data.heldout_fraction", config.heldout_fraction, "a fraction in (0, 1)")
  if config.kind == "stdlib":
    corpus = _load_stdlib(config.path, config.heldout_fraction, vocab_size, max_bytes,
                          cache_dir)
  elif config.kind == "tokens":
    corpus = _load_token_file(config.path, config.token_dtype, config.heldout_fraction,
                              vocab_size)
  elif config.kind == "synthetic":
    corpus = _make_synthetic(synthetic_tokens, config.heldout_fraction, vocab_size)
  elif config.kind == "prepared":
    corpus = _load_prepared(config.path, vocab_size)
  else:
    raise ConfigError("data.kind", config.kind,
                      "one of 'stdlib', 'tokens', 'synthetic', 'prepared'")
  if config.document_mask:
    if corpus.eod is None:
      raise ConfigError("data.document_mask", True, f"False for data.kind={config.kind!r}, "
                        f"which has no document boundaries")
    corpus = dataclasses.replace(corpus, document_mask=True)
  log.info("corpus %s", corpus.description)
  return corpus


def _load_prepared(path, vocab_size) -> Corpus:
  folder = os.path.abspath(path) if path else path
  manifest, train, heldout = prepared.load(folder, vocab_size)
  return Corpus(train, heldout, prepared.describe(folder, manifest), kind="prepared",
                eod=manifest["eod_id"], folder=folder, manifest=manifest)


def record_corpus(corpus: Corpus, workdir: str) -> None:
  """Copies a prepared corpus's manifest and tokenizer to WORKDIR/data/ (no-op for others).

  So a run names what it trained on (with the checksums), and `experiments/sample.py` finds
  the tokenizer even if the prepared folder moves. Call on one process.
  """
  if corpus.manifest is None:
    return
  folder = os.path.join(workdir, "data")
  os.makedirs(folder, exist_ok=True)
  target = os.path.join(folder, TOKENIZER_FILE)
  shutil.copyfile(os.path.join(corpus.folder, TOKENIZER_FILE), target + ".tmp")
  os.replace(target + ".tmp", target)
  write_json(os.path.join(folder, prepared.MANIFEST_FILE),
             {**corpus.manifest, "prepared_folder": corpus.folder}, indent=2)


def stdlib_folder() -> str:
  """The folder of this interpreter's standard library (e.g. /usr/lib/python3.11)."""
  return sysconfig.get_paths().get("stdlib") or os.path.dirname(os.__file__)


def _stdlib_files(folder: str) -> list[str]:
  """*.py files under `folder` (site-packages skipped), sorted by relative path."""
  found = []
  for parent, dirs, files in os.walk(folder):
    dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS]
    found += [os.path.relpath(os.path.join(parent, f), folder) for f in files
              if f.endswith(".py")]
  return sorted(found)


def _heldout_every(heldout_fraction: float) -> int:
  return max(2, round(1.0 / heldout_fraction))


def _load_stdlib(path, heldout_fraction, vocab_size, max_bytes, cache_dir=None) -> Corpus:
  if vocab_size < 256:
    raise ConfigError("model.vocab_size", vocab_size,
                      "at least 256: the stdlib corpus uses byte tokens (0..255)")
  folder = path or stdlib_folder()
  if not os.path.isdir(folder):
    raise ConfigError("data.path", path, "an existing folder of Python source for kind='stdlib'"
                      " (None: this interpreter's standard library)")
  every = _heldout_every(heldout_fraction)
  files = _stdlib_files(folder)
  cached = cache_dir and os.path.join(
      cache_dir, f"stdlib-{_stdlib_key(folder, files, every, max_bytes)}.npz")
  if cached and (corpus := _read_cached(cached)) is not None:
    return corpus
  train, heldout, total, num_files = [], [], 0, 0
  for rel in files:
    try:
      with open(os.path.join(folder, rel), "rb") as f:
        text = f.read()
    except OSError:
      continue
    if not text:
      continue
    if total + len(text) > max_bytes:
      break
    (heldout if num_files % every == every - 1 else train).append(text)
    total += len(text)
    num_files += 1
  if not train or not heldout:
    raise ConfigError("data.path", path or folder,
                      f"a folder with at least {every} non-empty .py files (under max_bytes="
                      f"{max_bytes:,}) to hold out every {every}th; found {num_files}")
  sep = bytes([SEPARATOR])
  to_tokens = lambda texts: np.frombuffer(sep.join(texts) + sep, dtype=np.uint8)
  train_tokens, heldout_tokens = to_tokens(train), to_tokens(heldout)
  description = (f"stdlib: {num_files:,} files, {total / 1e6:.1f} MB from {folder}; held out "
                 f"every {every}th file ({len(heldout):,} files, {heldout_tokens.size:,} tokens)")
  corpus = Corpus(train_tokens, heldout_tokens, description, kind="stdlib", eod=SEPARATOR)
  if cached:
    _write_cached(cached, corpus)
  return corpus


def _stdlib_key(folder: str, files: list[str], every: int, max_bytes: int) -> str:
  """What the stdlib corpus is built from: the folder, the split and cap, and each file's
  relative path, size and modification time (as make and rsync judge a file unchanged)."""
  digest = hashlib.sha256(f"stdlib v1\0{folder}\0{every}\0{max_bytes}\0{SEPARATOR}".encode())
  for rel in files:
    try:
      stat = os.stat(os.path.join(folder, rel))
      digest.update(f"\0{rel}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    except OSError:
      digest.update(f"\0{rel}\0unreadable".encode())
  return digest.hexdigest()[:32]


def _read_cached(path: str) -> Corpus | None:
  """The stdlib corpus cached at `path`, or None if there is none or it cannot be read."""
  if not os.path.exists(path):
    return None
  try:
    with np.load(path) as saved:
      train, heldout, description = saved["train"], saved["heldout"], str(saved["description"])
  except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
    log.warning("corpus cache: could not read %s (%s: %s); reading the files", path,
                type(e).__name__, e)
    return None
  log.info("corpus tokens read back from %s", path)
  return Corpus(train, heldout, description, kind="stdlib", eod=SEPARATOR)


def _write_cached(path: str, corpus: Corpus) -> None:
  """Writes `corpus` to `path` whole or not at all and drops the folder's older versions."""
  folder, temp = os.path.dirname(path), None
  try:
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".tmp", delete=False) as f:
      temp = f.name
      np.savez(f, train=corpus.train, heldout=corpus.heldout, description=corpus.description)
    os.replace(temp, path)
  except OSError as e:
    log.warning("corpus cache: could not write %s (%s)", path, e)
    if temp is not None and os.path.exists(temp):
      os.remove(temp)
    return
  for old in os.listdir(folder):   # a peer process may drop the same ones at the same time
    if old.startswith("stdlib-") and old.endswith(".npz") and old != os.path.basename(path):
      try:
        os.remove(os.path.join(folder, old))
      except FileNotFoundError:
        pass


def run_tokenizer(workdir: str, data_meta: dict):
  """The tokenizer a run trained with: its recorded prepared tokenizer (WORKDIR/data/), the
  prepared folder's (`data_meta`: the run's saved data config), bytes for the stdlib corpus,
  or None (token ids only).

  Raises:
    ConfigError: a prepared run whose tokenizer is neither in WORKDIR/data/ nor at data.path.
  """
  from mscale_jax.text.tokenizer import BPETokenizer
  recorded = os.path.join(workdir, "data")
  kind = data_meta.get("kind")
  if os.path.isfile(os.path.join(recorded, TOKENIZER_FILE)):
    folder = recorded
  elif kind == "prepared":
    folder = data_meta.get("path")
    if not folder or not os.path.isfile(os.path.join(folder, TOKENIZER_FILE)):
      raise ConfigError("--workdir", workdir, f"a run with its tokenizer in {recorded} or at "
                        f"its data.path={folder!r} (neither has {TOKENIZER_FILE}); pass "
                        f"--tokenizer=PATH/{TOKENIZER_FILE}")
  elif kind == "stdlib":
    return ByteTokenizer(SEPARATOR)
  else:
    return None
  manifest = prepared.read_manifest(folder, field="--workdir")
  return BPETokenizer.from_file(os.path.join(folder, TOKENIZER_FILE), manifest["eod_token"],
                                field="--workdir")


def _load_token_file(path, token_dtype, heldout_fraction, vocab_size) -> Corpus:
  if not path:
    raise ConfigError("data.path", path, "a token file is required when data.kind='tokens'")
  if not os.path.isfile(path):
    raise ConfigError("data.path", path, "an existing file of flat uint16/uint32 tokens")
  if token_dtype not in ("uint16", "uint32"):
    raise ConfigError("data.token_dtype", token_dtype, "one of 'uint16', 'uint32'")
  dtype = np.dtype(token_dtype)
  size = os.path.getsize(path)
  if size == 0:
    raise ConfigError("data.path", path, "a non-empty token file (this one has 0 bytes)")
  if size % dtype.itemsize:
    raise ConfigError("data.path", path,
                      f"a file of {token_dtype} tokens, whose size is a multiple of "
                      f"{dtype.itemsize} bytes; this one has {size:,} bytes (check "
                      f"data.token_dtype)")
  tokens = np.memmap(path, dtype=dtype, mode="r")
  largest = _max_token(tokens)
  if largest >= vocab_size:
    raise ConfigError("model.vocab_size", vocab_size,
                      f"greater than every token: {path} holds token {largest} (check "
                      f"data.token_dtype={token_dtype!r})")
  split = tokens.size - int(tokens.size * heldout_fraction)
  description = (f"tokens: {tokens.size:,} {token_dtype} tokens from {path}; held out the last "
                 f"{tokens.size - split:,}")
  return Corpus(tokens[:split], tokens[split:], description, kind="tokens")


def _max_token(tokens: np.ndarray) -> int:
  """Largest token: exact up to `_FULL_CHECK_TOKENS`, else over 64 evenly spaced 1M chunks."""
  chunk = 1 << 20
  if tokens.size <= _FULL_CHECK_TOKENS:
    starts = range(0, tokens.size, chunk * 16)
    return max(int(tokens[s:s + chunk * 16].max()) for s in starts)
  starts = np.linspace(0, tokens.size - chunk, 64).astype(np.int64)
  return max(int(tokens[s:s + chunk].max()) for s in starts)


def _make_synthetic(num_tokens, heldout_fraction, vocab_size) -> Corpus:
  dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
  rng = np.random.default_rng(SYNTHETIC_SEED)
  tokens = rng.integers(0, vocab_size, size=num_tokens, dtype=dtype)
  split = num_tokens - int(num_tokens * heldout_fraction)
  description = (f"synthetic: {num_tokens:,} uniform tokens below {vocab_size} (seed "
                 f"{SYNTHETIC_SEED:#x}); held out the last {num_tokens - split:,}")
  return Corpus(tokens[:split], tokens[split:], description, kind="synthetic")


def num_windows(tokens: np.ndarray, seq_len: int) -> int:
  """How many non-overlapping (seq_len + 1)-token windows the grid fits in `tokens`."""
  return (tokens.size - 1) // seq_len


def _check_windows(tokens: np.ndarray, seq_len: int, split: str) -> int:
  _positive("model.seq_len", seq_len)
  count = num_windows(tokens, seq_len)
  if count < 1:
    raise ConfigError("model.seq_len", seq_len,
                      f"at most {max(tokens.size - 1, 0)}: the {split} split has only "
                      f"{tokens.size:,} tokens, too few for one sequence of seq_len + 1")
  return count


def _positive(field: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ConfigError(field, value, "a positive integer")


def _local_rows(batch: int, process_index: int, process_count: int, field: str) -> slice:
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ConfigError("process_index", process_index,
                      f"an index in [0, {process_count}) with process_count >= 1")
  if batch % process_count:
    raise ConfigError(field, batch, f"must be divisible by the process count {process_count}")
  local = batch // process_count
  return slice(process_index * local, (process_index + 1) * local)


class _Windows:
  """Maps an array of window ids [b] to {'inputs', 'targets'}: int32 [b, seq_len], plus
  'segment_ids' (int32 [b, seq_len], see the module docstring) when `eod` is given."""

  def __init__(self, tokens: np.ndarray, seq_len: int, eod: int | None = None):
    self._tokens = tokens
    self._seq_len = seq_len
    self._eod = eod
    self._offsets = np.arange(seq_len + 1, dtype=np.int64)

  def __call__(self, window_ids) -> dict[str, np.ndarray]:
    starts = np.asarray(window_ids, dtype=np.int64) * self._seq_len
    rows = np.asarray(self._tokens[starts[:, None] + self._offsets], dtype=np.int32)
    batch = {"inputs": rows[:, :-1], "targets": rows[:, 1:]}
    if self._eod is not None:
      batch["segment_ids"] = np.cumsum(batch["inputs"] == self._eod, axis=1, dtype=np.int32)
    return batch

  def __repr__(self) -> str:
    return f"_Windows(seq_len={self._seq_len})"


def shuffle_seed(seed: int) -> int:
  """grain's 32-bit shuffle seed for the data seed `seed`.

  grain shuffles epoch e with its seed + e; mixing `seed` first keeps seed s's epoch e from
  replaying seed s + 1's epoch e - 1.
  """
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
    raise ConfigError("data.seed", seed, "a non-negative integer")
  return int(np.random.SeedSequence([int(seed), 0x6D73]).generate_state(1)[0])


class TrainIterator:
  """Infinite iterator of this process's rows of each global batch; checkpointable.

  Yields {'inputs': int32 [local_batch, seq_len], 'targets': int32 [local_batch, seq_len]}.
  `get_state()` is a JSON-serialisable dict holding the number of global batches taken; it is
  the same on every process, and may be restored with a different process count.
  """

  def __init__(self, tokens: np.ndarray, *, seq_len: int, global_batch: int, seed: int,
               process_index: int = 0, process_count: int = 1, prefetch: int = 2,
               segment_eod: int | None = None, corpus_id: str | None = None):
    self._windows = _check_windows(tokens, seq_len, "train")
    _positive("train.global_batch", global_batch)
    rows = _local_rows(global_batch, process_index, process_count, "train.global_batch")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
      raise ConfigError("data.prefetch", prefetch, "an integer >= 0 (0: no prefetching)")
    self._fingerprint = {"seed": int(seed), "seq_len": int(seq_len),
                         "global_batch": int(global_batch),
                         "num_windows": self._windows}
    if corpus_id is not None:      # a prepared corpus: resume only on the same token file
      self._fingerprint["corpus"] = corpus_id
    dataset = (grain.MapDataset.range(self._windows)
               .shuffle(seed=shuffle_seed(seed))
               .repeat()
               .batch(global_batch, drop_remainder=True)
               .map(lambda ids: ids[rows])
               .map(_Windows(tokens, seq_len, segment_eod)))
    # grain's own prefetch: a thread pool computes the next `prefetch` batches in the
    # background while the caller's step runs; its state counts batches returned, not computed.
    read_options = grain.ReadOptions(num_threads=1 if prefetch else 0,
                                     prefetch_buffer_size=prefetch)
    self._iterator = iter(dataset.to_iter_dataset(read_options))

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._iterator)

  def get_state(self) -> dict[str, Any]:
    """{'version', 'step' (global batches taken), and the settings the step is valid for}."""
    step = int(self._iterator.get_state()["next_index"])
    return {"version": _STATE_VERSION, "step": step, **self._fingerprint}

  def set_state(self, state: dict[str, Any]) -> None:
    """Resumes so that the next batch is the one that followed when `state` was taken."""
    if state.get("version") != _STATE_VERSION:
      raise ConfigError("data state", state, f"a state from get_state() (version "
                        f"{_STATE_VERSION})")
    for key, value in self._fingerprint.items():
      if state.get(key) != value:
        field = {"seed": "data.seed", "seq_len": "model.seq_len",
                 "global_batch": "train.global_batch", "num_windows": "data",
                 "corpus": "data.path"}[key]
        raise ConfigError(field, value, f"the saved data state was taken with {key}="
                          f"{state.get(key)!r}; resuming exactly needs the same")
    self._iterator.set_state({"next_index": int(state["step"])})

  def close(self) -> None:
    """Stops the prefetch threads."""
    self._iterator.close()


def make_train_iterator(corpus: Corpus, *, seq_len: int, global_batch: int, seed: int,
                        process_index: int = 0, process_count: int = 1,
                        prefetch: int = 2) -> TrainIterator:
  """The training stream: this process's int32 [global_batch // process_count, seq_len] rows
  (with 'segment_ids' when the corpus asks for a document mask).

  Raises:
    ConfigError: the train split is shorter than seq_len + 1 tokens, or global_batch is not
      divisible by process_count.
  """
  return TrainIterator(corpus.train, seq_len=seq_len, global_batch=global_batch, seed=seed,
                       process_index=process_index, process_count=process_count,
                       prefetch=prefetch, segment_eod=_segment_eod(corpus),
                       corpus_id=corpus.fingerprint)


def _segment_eod(corpus: Corpus) -> int | None:
  return corpus.eod if corpus.document_mask else None


def make_eval_batches(corpus: Corpus, *, seq_len: int, batch_size: int, num_batches: int,
                      process_index: int = 0, process_count: int = 1
                      ) -> list[dict[str, np.ndarray]]:
  """A fixed held-out set: `num_batches` batches of int32 [batch_size, seq_len] windows.

  The batch_size * num_batches windows are spread evenly over the held-out grid (window ids
  floor(j * count / needed)), so they sample every part of it; if the grid has fewer windows
  than needed, ids wrap around. Independent of any seed. With process_count > 1, batch_size is
  the global eval batch and each process gets its rows, as in training.
  """
  count = _check_windows(corpus.heldout, seq_len, "held-out")
  _positive("eval batch_size", batch_size)
  _positive("train.eval_batches", num_batches)
  rows = _local_rows(batch_size, process_index, process_count, "eval batch_size")
  needed = batch_size * num_batches
  if needed <= count:
    ids = np.arange(needed, dtype=np.int64) * count // needed
  else:
    ids = np.arange(needed, dtype=np.int64) % count
  windows = _Windows(corpus.heldout, seq_len, _segment_eod(corpus))
  return [windows(batch[rows]) for batch in ids.reshape(num_batches, batch_size)]


def decode(tokens) -> str:
  """Byte-tokenizer decoding of a 1-D token sequence; tokens outside 0..255 become U+FFFD."""
  return ByteTokenizer(SEPARATOR).decode(tokens)
