"""The prepare step (mscale_jax.text, experiments/prepare_data.py): sources, BPE, splits, files."""
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mscale_jax.errors import ConfigError
from mscale_jax.text import prepare, prepared, sources
from mscale_jax.text.tokenizer import EOD_TOKEN, BPETokenizer, train_bpe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("alpha beta gamma delta def return class import lambda yield über naïve 漢字 "
         "🙂 x1 y22 z333").split()


def _documents(n: int, seed: int) -> list[str]:
  """Random multi-line documents of random words, punctuation and whitespace (Unicode too)."""
  rng = np.random.default_rng(seed)
  docs = []
  for _ in range(n):
    parts = [rng.choice(WORDS) + rng.choice(["", " ", "  ", "\n", "\t", ", ", "(", ")\n"])
             for _ in range(int(rng.integers(5, 60)))]
    docs.append("".join(parts))
  return docs


def _write_corpus(root, docs):
  """The documents as text files, a JSON Lines file, a Parquet file and a saved HF dataset;
  returns the inputs (in reading order) and the documents in that order."""
  import datasets
  import pyarrow as pa
  import pyarrow.parquet as pq
  texts, jsonl, parquet, saved = docs[:8], docs[8:16], docs[16:24], docs[24:]
  folder = root / "texts"
  folder.mkdir()
  for i, text in enumerate(texts):
    (folder / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
  (folder / "notes.md").write_text("not matched by --glob")
  with gzip.open(root / "records.jsonl.gz", "wt", encoding="utf-8") as f:
    for text in jsonl:
      f.write(json.dumps({"id": 1, "body": text}) + "\n\n")    # blank lines are skipped
  pq.write_table(pa.table({"body": parquet}), root / "table.parquet")
  datasets.Dataset.from_dict({"body": saved}).save_to_disk(str(root / "saved"))
  inputs = [str(folder), str(root / "records.jsonl.gz"), str(root / "table.parquet"),
            str(root / "saved")]
  return inputs, texts + jsonl + parquet + saved


def _split_documents(folder, manifest, split) -> list[list[int]]:
  """A split's token file cut at the end-of-document tokens."""
  tokens = np.fromfile(os.path.join(folder, f"{split}.bin"), dtype=manifest["token_dtype"])
  assert tokens.size and tokens[-1] == manifest["eod_id"]
  ends = np.flatnonzero(tokens == manifest["eod_id"])
  starts = np.concatenate([[0], ends[:-1] + 1])
  return [tokens[s:e].tolist() for s, e in zip(starts, ends)]


READ = sources.ReadOptions(glob="*.txt", text_field="body")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("corpus")
  inputs, docs = _write_corpus(root, _documents(32, seed=3))
  out = root / "prepared"
  options = prepare.PrepareOptions(vocab_size=320, heldout_fraction=0.25, seed=5)
  result = prepare.prepare(inputs, str(out), options, READ, show_progress=False)
  return inputs, docs, str(out), result.manifest


def test_round_trip_text_tokens_text():
  tokenizer = train_bpe(iter(_documents(20, seed=0)), 300)
  assert tokenizer.vocab_size == 300 and tokenizer.eod == 0
  unseen = ["Grüße, 世界! ∮ E⋅da = Q\r\n\ttabs  and   spaces\u00a0\u200b🙂🚀", "", " x",
            f"text that spells {EOD_TOKEN} is text", "\x00\x01 control \x7f"]
  for text in _documents(5, seed=1) + unseen:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert all(0 < i < 300 for i in ids)        # the end-of-document id only from the prepare
  merged = tokenizer.encode("alpha beta gamma")
  assert len(merged) < len("alpha beta gamma")  # merges were learned, not just bytes


def test_documents_end_where_the_eod_tokens_are(corpus):
  inputs, docs, out, manifest = corpus
  tokenizer = BPETokenizer.from_file(os.path.join(out, "tokenizer.json"))
  pieces = {split: [tokenizer.decode(p) for p in _split_documents(out, manifest, split)]
            for split in prepared.SPLITS}
  train, heldout = pieces["train"], pieces["heldout"]
  # Every document is in exactly one split, whole, and each split keeps the reading order.
  assert sorted(train + heldout) == sorted(docs)
  assert train == [d for d in docs if d in train] and heldout == [d for d in docs if d in heldout]
  assert len(heldout) >= 3 and len(train) >= 20
  assert manifest["documents"] == len(docs)
  assert manifest["splits"]["heldout"]["documents"] == len(heldout)
  assert manifest["splits"]["train"]["text_bytes"] == sum(len(d.encode()) for d in train)
  assert [s["documents"] for s in manifest["sources"]] == [8, 8, 8, 8]
  assert manifest["vocab_size"] == 320 and manifest["token_dtype"] == "uint16"


def test_prepare_is_deterministic_for_a_seed(corpus, tmp_path):
  """The command line in a fresh process writes the same bytes as the library did here."""
  inputs, _, out, _ = corpus
  result = run_prepare(*[f"--input={p}" for p in inputs], f"--out={tmp_path / 'again'}",
                       "--vocab_size=320", "--heldout_fraction=0.25", "--seed=5",
                       "--glob=*.txt", "--text_field=body")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "32 documents" in result.stdout
  for name in ("train.bin", "heldout.bin", "tokenizer.json", "manifest.json"):
    with open(os.path.join(out, name), "rb") as a, open(tmp_path / "again" / name, "rb") as b:
      assert a.read() == b.read(), name
  other = prepare.prepare(inputs, str(tmp_path / "seed6"), prepare.PrepareOptions(
      vocab_size=320, heldout_fraction=0.25, seed=6), READ, show_progress=False).manifest
  assert other["splits"]["heldout"]["sha256"] != corpus[3]["splits"]["heldout"]["sha256"]


def test_invalid_utf8_is_skipped_and_counted_or_fails(tmp_path):
  (tmp_path / "good.txt").write_text("plain text " * 20)
  (tmp_path / "good2.txt").write_text("more text " * 20)
  (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
  options = prepare.PrepareOptions(vocab_size=260, heldout_fraction=0.5, seed=1)
  manifest = prepare.prepare([str(tmp_path)], str(tmp_path / "out"), options,
                             sources.ReadOptions(glob="*.txt"), show_progress=False).manifest
  assert manifest["documents"] == 2 and manifest["skipped"]["invalid_utf8"] == 1
  assert manifest["sources"][0]["invalid_utf8_examples"] == [str(tmp_path / "latin1.txt")]
  with pytest.raises(ConfigError, match="latin1.txt.*UTF-8"):
    prepare.prepare([str(tmp_path)], str(tmp_path / "out2"), options,
                    sources.ReadOptions(glob="*.txt", on_invalid_utf8="fail"),
                    show_progress=False)


def test_an_output_folder_inside_the_input_is_not_read_back(tmp_path):
  for i, text in enumerate(_documents(6, seed=7)):
    (tmp_path / f"doc{i}.md").write_text(text)
  options = prepare.PrepareOptions(vocab_size=270, heldout_fraction=0.3, seed=0, overwrite=True)
  run = lambda: prepare.prepare([str(tmp_path)], str(tmp_path / "out"), options,
                                show_progress=False).manifest
  first, again = run(), run()                         # the second run sees out/ in the input
  assert first["documents"] == again["documents"] == 6
  assert first["splits"] == again["splits"]


def test_checksums_catch_a_changed_file(corpus, tmp_path):
  import shutil
  _, _, out, manifest = corpus
  copy = tmp_path / "copy"
  shutil.copytree(out, copy)
  prepared.verify(str(copy), manifest)                    # unchanged: passes
  with open(copy / "train.bin", "r+b") as f:
    f.seek(10)
    byte = f.read(1)
    f.seek(10)
    f.write(bytes([byte[0] ^ 1]))
  with pytest.raises(ConfigError, match="SHA-256 of train.bin"):
    prepared.load(str(copy), 320)
  with pytest.raises(ConfigError, match="model.vocab_size=256.*at least 320"):
    prepared.load(out, 256)


def test_a_given_tokenizer_is_used_and_recorded(corpus, tmp_path):
  inputs, docs, out, manifest = corpus
  result = prepare.prepare(inputs, str(tmp_path / "given"), prepare.PrepareOptions(
      tokenizer=os.path.join(out, "tokenizer.json"), heldout_fraction=0.25, seed=5,
      token_dtype="uint32"), READ, show_progress=False).manifest
  assert result["tokenizer"]["sha256"] == manifest["tokenizer"]["sha256"]
  assert result["token_dtype"] == "uint32" and result["tokens"] == manifest["tokens"]


def run_prepare(*args):
  env = dict(os.environ, PYTHONPATH=REPO)
  return subprocess.run([sys.executable, "-m", "experiments.prepare_data", *args], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case,message", [
    ("missing", "--input='{root}/nowhere' is invalid: an existing file or folder"),
    ("empty", "a corpus with at least one training document; found none (skipped 2 empty"),
    ("not_utf8", "UTF-8 text"),
    ("dtype", "--token_dtype='uint16' is invalid: a dtype that holds 70,000 token ids"),
    ("no_vocab", "--vocab_size=None"),
    ("field", "--text_field='text' is invalid: a string field of every JSON Lines record"),
    ("exists", "--out="),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case, message):
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "a.txt").write_text("")
  (tmp_path / "empty" / "b.txt").write_text("")
  (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
  (tmp_path / "records.jsonl").write_text('{"body": "x"}\n')
  (tmp_path / "done").mkdir()
  (tmp_path / "done" / "manifest.json").write_text("{}")
  out = f"--out={tmp_path / 'out'}"
  args = {"missing": [f"--input={tmp_path}/nowhere", out, "--vocab_size=300"],
          "empty": [f"--input={tmp_path / 'empty'}", out, "--vocab_size=300"],
          "not_utf8": [f"--input={tmp_path / 'latin1.txt'}", out, "--vocab_size=300",
                       "--on_invalid_utf8=fail"],
          "dtype": [f"--input={tmp_path / 'records.jsonl'}", out, "--vocab_size=70000",
                    "--token_dtype=uint16"],
          "no_vocab": [f"--input={tmp_path / 'records.jsonl'}", out],
          "field": [f"--input={tmp_path / 'records.jsonl'}", out, "--vocab_size=300"],
          "exists": [f"--input={tmp_path / 'records.jsonl'}", f"--out={tmp_path / 'done'}",
                     "--vocab_size=300", "--text_field=body"]}[case]
  result = run_prepare(*args)
  assert result.returncode == 2, result.stderr[-3000:]
  lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(lines) == 1 and message.format(root=tmp_path) in lines[0], result.stderr[-3000:]
  assert "Traceback" not in result.stderr
  assert not (tmp_path / "out" / "manifest.json").exists()
