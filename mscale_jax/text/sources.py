"""Documents streamed from the prepare step's inputs, always in the same order.

An input is a path:
  a folder             every file under it whose name matches `glob`, in sorted relative-path
                       order (hidden folders, __pycache__ and names matching an `exclude`
                       pattern skipped), each read by its kind below; a folder saved by HF
                       `datasets` (`save_to_disk`) is that dataset
  *.jsonl, *.ndjson,   one document per line: the string field `text_field` of each record
  *.jsonl.gz
  *.parquet            one document per row: the string column `text_field`
  any other file       one document: the whole file as UTF-8 text
`format` forces one reader for every file ('text', 'jsonl', 'parquet') or the dataset ('hf').

Only a plain text file is read whole (it is one document); JSON Lines go line by line, Parquet
and saved datasets in record batches, so memory stays bounded for corpora larger than memory.
Text that is not UTF-8 is skipped and counted, or is an error (`on_invalid_utf8`); empty
documents are skipped and counted.
"""
import dataclasses
import fnmatch
import gzip
import json
import os
from collections.abc import Iterator

from mscale_jax.errors import ConfigError

FORMATS = ("auto", "text", "jsonl", "parquet", "hf")
INVALID_UTF8_POLICIES = ("skip", "fail")
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
_SKIPPED_DIRS = ("__pycache__",)
_BATCH_ROWS = 1024                 # Parquet / Arrow rows per record batch
_EXAMPLES = 5                      # skipped files named in the manifest, per input


@dataclasses.dataclass(frozen=True)
class ReadOptions:
  """How inputs are read (the prepare step's flags of the same names)."""
  glob: str = "*"
  exclude: tuple[str, ...] = ()    # fnmatch patterns of folder or file names to skip
  text_field: str = "text"
  format: str = "auto"
  on_invalid_utf8: str = "skip"
  split: str = "train"             # the split of a saved DatasetDict


@dataclasses.dataclass
class InputStats:
  """What one input contributed, and what was skipped (first few named)."""
  path: str
  format: str
  files: int
  documents: int = 0
  bytes: int = 0
  skipped_invalid_utf8: int = 0
  skipped_empty: int = 0
  invalid_utf8_examples: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Input:
  """One --input path and its files in reading order, each with its reader's format."""
  path: str
  files: tuple[tuple[str, str], ...]

  def stats(self) -> InputStats:
    formats = sorted({fmt for _, fmt in self.files})
    return InputStats(self.path, "+".join(formats), len(self.files))


def find_inputs(paths, options: ReadOptions, *, skip: str | None = None) -> list[Input]:
  """The inputs' files, in reading order; none under the folder `skip` (the output folder,
  so a prepared folder inside an input folder is never read as documents).

  Raises:
    ConfigError: no path given, a path that does not exist, a folder with no matching file,
      or a bad option.
  """
  _check_options(options)
  if not paths:
    raise ConfigError("--input", paths, "one or more files or folders of documents")
  inputs = []
  for path in paths:
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(full):
      raise ConfigError("--input", path, "an existing file or folder")
    if options.format == "hf" or (options.format == "auto" and _is_saved_dataset(full)):
      if not os.path.isdir(full):
        raise ConfigError("--input", path, "a folder written by datasets' save_to_disk for "
                          "--format=hf")
      inputs.append(Input(full, ((full, "hf"),)))
      continue
    if os.path.isdir(full):
      names = _walk(full, options.glob, options.exclude, skip)
      if not names:
        raise ConfigError("--input", path, f"a folder with files matching "
                          f"--glob={options.glob!r} (it has none)")
      files = tuple((os.path.join(full, n), _format_of(n, options.format)) for n in names)
    else:
      files = ((full, _format_of(full, options.format)),)
    inputs.append(Input(full, files))
  return inputs


def _check_options(options: ReadOptions) -> None:
  if options.format not in FORMATS:
    raise ConfigError("--format", options.format, f"one of {', '.join(FORMATS)}")
  if options.on_invalid_utf8 not in INVALID_UTF8_POLICIES:
    raise ConfigError("--on_invalid_utf8", options.on_invalid_utf8,
                      f"one of {', '.join(INVALID_UTF8_POLICIES)}")
  if not options.text_field:
    raise ConfigError("--text_field", options.text_field, "the name of the text field")


def _is_saved_dataset(path: str) -> bool:
  exists = lambda name: os.path.isfile(os.path.join(path, name))
  return exists("dataset_dict.json") or (exists("state.json") and exists("dataset_info.json"))


def _walk(folder: str, pattern: str, exclude: tuple[str, ...], skip_folder: str | None
          ) -> list[str]:
  skip = lambda name: name.startswith(".") or any(fnmatch.fnmatch(name, p) for p in exclude)
  skip_folder = os.path.abspath(skip_folder) if skip_folder else None
  found = []
  for parent, dirs, files in os.walk(folder):
    dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS and not skip(d)
               and os.path.join(parent, d) != skip_folder]
    found += [os.path.relpath(os.path.join(parent, f), folder) for f in files
              if fnmatch.fnmatch(f, pattern) and not skip(f)]
  return sorted(found)


def _format_of(name: str, forced: str) -> str:
  if forced != "auto":
    return forced
  lower = name.lower()
  if lower.endswith(_JSONL_SUFFIXES):
    return "jsonl"
  if lower.endswith(".parquet"):
    return "parquet"
  return "text"


def documents(inputs: list[Input], options: ReadOptions,
              stats: list[InputStats]) -> Iterator[tuple[str, bytes]]:
  """Every non-empty document of `inputs` in order, as (text, its UTF-8 bytes).

  `stats[i]` (from `inputs[i].stats()`) counts input i's documents, bytes and skips as the
  documents are read.

  Raises:
    ConfigError: text that is not UTF-8 under on_invalid_utf8='fail'; a JSON Lines record or
      table without a string `text_field`; a file that cannot be read.
  """
  readers = {"text": _text_file, "jsonl": _jsonl_file, "parquet": _parquet_file,
             "hf": _saved_dataset}
  for source, stat in zip(inputs, stats):
    for path, fmt in source.files:
      for text, data in readers[fmt](path, options, stat):
        if not data:
          stat.skipped_empty += 1
          continue
        stat.documents += 1
        stat.bytes += len(data)
        yield text, data


def _invalid(stat: InputStats, where: str, options: ReadOptions, error: Exception) -> None:
  """Counts text that is not UTF-8, or raises under on_invalid_utf8='fail'."""
  if options.on_invalid_utf8 == "fail":
    raise ConfigError("--input", where, f"UTF-8 text ({error}); --on_invalid_utf8=skip skips "
                      f"such documents and counts them")
  stat.skipped_invalid_utf8 += 1
  if len(stat.invalid_utf8_examples) < _EXAMPLES:
    stat.invalid_utf8_examples.append(where)


def _read_error(path: str, error: OSError) -> ConfigError:
  return ConfigError("--input", path, f"a readable file ({error.strerror or error})")


def _text_file(path, options, stat):
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise _read_error(path, e) from None
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    _invalid(stat, path, options, e)
    return
  yield text, data


def _jsonl_file(path, options, stat):
  field = options.text_field
  opener = gzip.open if path.lower().endswith(".gz") else open
  try:
    with opener(path, "rb") as f:
      for number, line in enumerate(f, start=1):
        if not line.strip():
          continue
        where = f"{path}:{number}"
        try:
          record = json.loads(line)
        except UnicodeDecodeError as e:
          _invalid(stat, where, options, e)
          continue
        except ValueError as e:
          raise ConfigError("--input", where, f"one JSON object per line ({e})") from None
        text = record.get(field) if isinstance(record, dict) else None
        if not isinstance(text, str):
          keys = sorted(record) if isinstance(record, dict) else type(record).__name__
          raise ConfigError("--text_field", field, f"a string field of every JSON Lines "
                            f"record; {where} has {keys}")
        try:
          data = text.encode("utf-8")
        except UnicodeEncodeError as e:    # a lone surrogate escaped in the JSON
          _invalid(stat, where, options, e)
          continue
        yield text, data
  except OSError as e:
    raise _read_error(path, e) from None


def _string_column(names, field: str, where: str) -> None:
  if field not in names:
    raise ConfigError("--text_field", field, f"a text column of {where}; its columns are "
                      f"{list(names)}")


def _optional(module: str, path: str):
  """Imports a reader's library (the `data` extra), or says how to install it."""
  import importlib
  try:
    return importlib.import_module(module)
  except ImportError:
    raise ConfigError("--input", path, f"an input whose reader is installed: {module} is "
                      f"missing (pip install 'mscale-jax[data]')") from None


def _parquet_file(path, options, stat):
  pa = _optional("pyarrow", path)
  pq = _optional("pyarrow.parquet", path)
  field = options.text_field
  try:
    table = pq.ParquetFile(path)
  except (OSError, pa.ArrowException) as e:
    raise ConfigError("--input", path, f"a Parquet file ({e})") from None
  _string_column(table.schema_arrow.names, field, path)
  kind = table.schema_arrow.field(field).type
  if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
    raise ConfigError("--text_field", field, f"a string column of {path}; it holds {kind}")
  for batch in table.iter_batches(batch_size=_BATCH_ROWS, columns=[field]):
    for text in batch.column(0).to_pylist():
      text = text or ""
      yield text, text.encode("utf-8")


def _saved_dataset(path, options, stat):
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")     # a saved dataset needs no network
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  datasets = _optional("datasets", path)
  try:
    dataset = datasets.load_from_disk(path)
  except (OSError, ValueError, FileNotFoundError) as e:
    raise ConfigError("--input", path, f"a dataset saved by datasets' save_to_disk "
                      f"({e})") from None
  if isinstance(dataset, datasets.DatasetDict):
    if options.split not in dataset:
      raise ConfigError("--split", options.split, f"one of the splits of {path}: "
                        f"{', '.join(dataset)}")
    dataset = dataset[options.split]
  _string_column(dataset.column_names, options.text_field, path)
  for batch in dataset.select_columns([options.text_field]).iter(batch_size=_BATCH_ROWS):
    for text in batch[options.text_field]:
      if text is not None and not isinstance(text, str):
        raise ConfigError("--text_field", options.text_field, f"a string column of {path}; "
                          f"it holds {type(text).__name__}")
      text = text or ""
      yield text, text.encode("utf-8")
