r"""Your own text as training data: documents in, byte-level BPE trained, token files out.

  python -m experiments.prepare_data --input=corpus/ --out=data/mycorpus --vocab_size=32000
  python -m experiments.prepare_data --input="$(python -c 'import sysconfig; \
      print(sysconfig.get_paths()["stdlib"])')" --glob='*.py' --exclude=site-packages \
      --out=data/stdlib-bpe4k --vocab_size=4096
  python -m experiments.prepare_data --input=shard-0.jsonl.gz --input=shard-1.jsonl.gz \
      --text_field=content --out=data/code --tokenizer=gpt2/tokenizer.json
  python -m experiments.prepare_data --input=train.parquet --out=data/pq --vocab_size=8192
  python -m experiments.prepare_data --input=saved_dataset/ --split=train --out=data/hf \
      --vocab_size=8192                 # a folder written by datasets' save_to_disk

then train on it with exactly these two fields (and the model's vocabulary at least the
tokenizer's):

  python -m experiments.train --config=experiments/configs/gpt_tiny.py \
      --config.data.kind=prepared --config.data.path=data/stdlib-bpe4k \
      --config.model.vocab_size=4096 [--config.data.document_mask=True]

Inputs are folders (every file matching --glob, sorted), text files (one document each), JSON
Lines (one document per line, field --text_field), Parquet (column --text_field) or datasets
saved with HF `datasets` (no network needed). The output folder holds train.bin and
heldout.bin (each document's tokens then the end-of-document token), tokenizer.json and
manifest.json (sources, counts, vocabulary, dtype, the held-out rule, SHA-256 of every file).
Held-out documents are whole documents picked by a hash of --seed and their text. Text is
streamed in batches and encoded on all cores; a progress bar shows documents, tokens and MB
per second. Bad input (a missing path, an empty corpus, a non-UTF-8 file under
--on_invalid_utf8=fail, a vocabulary the token dtype cannot hold) prints one line and exits
with status 2.
"""
import json
import os
import sys

from absl import app, flags

from mscale_jax.errors import ConfigError

_INPUT = flags.DEFINE_multi_string("input", [], "A file or folder of documents; repeatable. "
                                   "Folders are read recursively in sorted order.")
_OUT = flags.DEFINE_string("out", None, "Folder to write train.bin, heldout.bin, "
                           "tokenizer.json and manifest.json to.")
_VOCAB = flags.DEFINE_integer("vocab_size", None, "Train a byte-level BPE tokenizer with this "
                              "many tokens (>= 257), ...")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "... or use this tokenizer.json instead.")
_EOD = flags.DEFINE_string("eod_token", "<|endoftext|>", "The end-of-document token (with "
                           "--tokenizer: one of its tokens, e.g. '</s>').")
_GLOB = flags.DEFINE_string("glob", "*", "In folders, read only files whose name matches "
                            "this pattern, e.g. '*.py' or '*.jsonl'.")
_EXCLUDE = flags.DEFINE_multi_string("exclude", [], "In folders, skip folders and files whose "
                                     "name matches this pattern, e.g. 'site-packages'; "
                                     "repeatable.")
_FORMAT = flags.DEFINE_enum("format", "auto", ["auto", "text", "jsonl", "parquet", "hf"],
                            "How to read files. auto: by extension (.jsonl/.ndjson[.gz]: JSON "
                            "Lines, .parquet: Parquet, else text), a save_to_disk folder as a "
                            "dataset.")
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "The text field of JSON Lines records, "
                                  "Parquet tables and datasets.")
_SPLIT = flags.DEFINE_string("split", "train", "The split of a saved DatasetDict to read.")
_ON_INVALID = flags.DEFINE_enum("on_invalid_utf8", "skip", ["skip", "fail"], "A document that "
                                "is not UTF-8: skip it (counted in the manifest) or stop with "
                                "an error.")
_HELDOUT = flags.DEFINE_float("heldout_fraction", 0.01, "Fraction of documents held out for "
                              "evaluation (chosen by a hash of --seed and the text).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the held-out choice.")
_DTYPE = flags.DEFINE_enum("token_dtype", "auto", ["auto", "uint16", "uint32"], "Token file "
                           "dtype; auto: uint16 when the vocabulary fits in it.")
_TOKENIZER_MB = flags.DEFINE_integer("tokenizer_mb", 1024, "Train the tokenizer on the first "
                                     "this many MB of training documents.")
_BATCH_MB = flags.DEFINE_integer("batch_mb", 4, "MB of text encoded per batch (memory use is "
                                 "a few times this).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace prepared data already in --out.")


def main(argv):
  del argv
  from mscale_jax.text import prepare, sources
  options = prepare.PrepareOptions(
      vocab_size=_VOCAB.value, tokenizer=_TOKENIZER.value, eod_token=_EOD.value,
      heldout_fraction=_HELDOUT.value, seed=_SEED.value, token_dtype=_DTYPE.value,
      tokenizer_bytes=_TOKENIZER_MB.value << 20, batch_bytes=_BATCH_MB.value << 20,
      overwrite=_OVERWRITE.value)
  read = sources.ReadOptions(glob=_GLOB.value, exclude=tuple(_EXCLUDE.value),
                             text_field=_TEXT_FIELD.value,
                             format=_FORMAT.value, on_invalid_utf8=_ON_INVALID.value,
                             split=_SPLIT.value)
  try:
    result = prepare.prepare(_INPUT.value, _OUT.value, options, read)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(summary(_OUT.value, result))


def summary(out: str, result) -> str:
  """What was written, in a few lines."""
  m = result.manifest
  train, heldout = m["splits"]["train"], m["splits"]["heldout"]
  skipped = m["skipped"]
  lines = [
      f"[prepare] {m['documents']:,} documents, {m['text_bytes'] / 1e6:,.1f} MB of text -> "
      f"{m['tokens']:,} {m['token_dtype']} tokens ({m['text_bytes'] / max(m['tokens'], 1):.2f} "
      f"bytes/token), vocabulary {m['vocab_size']:,} in {result.total_s:.1f} s "
      f"(tokenizer {result.tokenizer_s:.1f} s, encoding {result.encode_s:.1f} s: "
      f"{m['text_bytes'] / 1e6 / max(result.encode_s, 1e-9):.2f} MB/s)",
      f"  train   {train['documents']:,} documents, {train['tokens']:,} tokens",
      f"  heldout {heldout['documents']:,} documents, {heldout['tokens']:,} tokens",
      f"  skipped {skipped['empty']:,} empty, {skipped['invalid_utf8']:,} not UTF-8 "
      f"{_examples(m)}",
      f"  wrote   {os.path.abspath(out)}/{{train.bin, heldout.bin, tokenizer.json, "
      f"manifest.json}}",
      f"  train:  --config.data.kind=prepared --config.data.path={out} "
      f"--config.model.vocab_size={m['vocab_size']}",
  ]
  return "\n".join(lines)


def _examples(manifest: dict) -> str:
  names = [n for s in manifest["sources"] for n in s["invalid_utf8_examples"]]
  return f"(e.g. {json.dumps(names[:3])})" if names else ""


if __name__ == "__main__":
  app.run(main)
