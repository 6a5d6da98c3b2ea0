"""Tests for mscale_jax.data: corpora, splits, determinism, process split and exact resume."""
import json
import os

import numpy as np
import pytest

from mscale_jax import data
from mscale_jax.config import DataConfig
from mscale_jax.errors import ConfigError

SEQ = 8


def _counting_corpus(num_tokens=4001):
  """Tokens 0..n-1, so each window's content reveals where in the stream it came from."""
  tokens = np.arange(num_tokens, dtype=np.uint32)
  return data.Corpus(tokens, tokens[:200] + num_tokens, "counting")


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])
    np.testing.assert_array_equal(x["targets"], y["targets"])


def _write_tree(root, files):
  for name, text in files.items():
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  return root


def test_batches_are_windows_of_the_stream_with_shifted_targets():
  corpus = _counting_corpus()
  it = data.make_train_iterator(corpus, seq_len=SEQ, global_batch=4, seed=0)
  for batch in _take(it, 3):
    assert batch["inputs"].shape == batch["targets"].shape == (4, SEQ)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    for inputs, targets in zip(batch["inputs"], batch["targets"]):
      start = int(inputs[0])
      assert start % SEQ == 0                       # the fixed non-overlapping grid
      np.testing.assert_array_equal(inputs, corpus.train[start:start + SEQ])
      np.testing.assert_array_equal(targets, corpus.train[start + 1:start + SEQ + 1])
  it.close()


def test_same_seed_same_batches_other_seed_other_batches():
  corpus = _counting_corpus()
  make = lambda seed: data.make_train_iterator(corpus, seq_len=SEQ, global_batch=4, seed=seed)
  first, again, other = _take(make(3), 4), _take(make(3), 4), _take(make(4), 4)
  _assert_batches_equal(first, again)
  assert not all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(first, other))


def test_each_epoch_is_a_permutation_reshuffled_per_epoch():
  corpus = _counting_corpus(num_tokens=12 * SEQ + 1)   # 12 windows: 3 batches of 4 per epoch
  it = data.make_train_iterator(corpus, seq_len=SEQ, global_batch=4, seed=1, prefetch=0)
  starts = [int(row[0]) // SEQ for batch in _take(it, 6) for row in batch["inputs"]]
  epoch0, epoch1 = starts[:12], starts[12:]
  assert sorted(epoch0) == sorted(epoch1) == list(range(12))
  assert epoch0 != epoch1


@pytest.mark.parametrize("prefetch", [0, 2])
def test_exact_resume_from_json_state(prefetch):
  corpus = _counting_corpus(num_tokens=20 * SEQ + 1)   # epochs end mid-run
  it = data.make_train_iterator(corpus, seq_len=SEQ, global_batch=8, seed=7, prefetch=prefetch)
  _take(it, 3)
  state = json.loads(json.dumps(it.get_state()))
  assert state["step"] == 3
  expected = _take(it, 2)
  it.close()
  fresh = data.make_train_iterator(corpus, seq_len=SEQ, global_batch=8, seed=7,
                                   prefetch=prefetch)
  _take(fresh, 1)                                     # restoring also rewinds a used iterator
  fresh.set_state(state)
  _assert_batches_equal(_take(fresh, 2), expected)
  fresh.close()


def test_state_restores_under_another_process_count():
  corpus = _counting_corpus()
  whole = data.make_train_iterator(corpus, seq_len=SEQ, global_batch=4, seed=2)
  _take(whole, 5)
  state = whole.get_state()
  expected = next(whole)
  half = data.make_train_iterator(corpus, seq_len=SEQ, global_batch=4, seed=2,
                                  process_index=1, process_count=2)
  half.set_state(state)
  np.testing.assert_array_equal(next(half)["inputs"], expected["inputs"][2:])


def test_state_from_other_settings_is_refused():
  corpus = _counting_corpus()
  state = data.make_train_iterator(corpus, seq_len=SEQ, global_batch=4, seed=0).get_state()
  other = data.make_train_iterator(corpus, seq_len=SEQ, global_batch=4, seed=1)
  with pytest.raises(ConfigError, match="data.seed"):
    other.set_state(state)


def test_processes_split_each_global_batch_by_rows():
  corpus = _counting_corpus()
  kwargs = dict(seq_len=SEQ, global_batch=6, seed=5)
  whole = _take(data.make_train_iterator(corpus, **kwargs), 4)
  parts = [_take(data.make_train_iterator(corpus, process_index=i, process_count=2, **kwargs), 4)
           for i in range(2)]
  for step, batch in enumerate(whole):
    for key in ("inputs", "targets"):
      assert parts[0][step][key].shape == (3, SEQ)
      joined = np.concatenate([parts[0][step][key], parts[1][step][key]])
      np.testing.assert_array_equal(joined, batch[key])


def test_stdlib_heldout_is_every_nth_file_whole_and_seed_independent(tmp_path):
  files = {f"pkg/mod{i:02d}.py": f"def f{i}():\n  return {i}\n" for i in range(10)}
  files["pkg/empty.py"] = ""                            # skipped: contributes no tokens
  files["site-packages/skip.py"] = "def skipped(): pass\n"
  _write_tree(tmp_path, files)
  config = DataConfig(kind="stdlib", path=str(tmp_path), heldout_fraction=0.25)
  corpus = data.load_corpus(config, 256)
  train_text, heldout_text = data.decode(corpus.train), data.decode(corpus.heldout)
  sep = chr(data.SEPARATOR)
  heldout_ids = {3, 7}                                 # every 4th file in sorted order
  assert heldout_text == "".join(files[f"pkg/mod{i:02d}.py"] + sep for i in sorted(heldout_ids))
  assert train_text == "".join(files[f"pkg/mod{i:02d}.py"] + sep
                               for i in range(10) if i not in heldout_ids)
  assert "skipped" not in train_text + heldout_text
  reseeded = data.load_corpus(DataConfig(kind="stdlib", path=str(tmp_path),
                                         heldout_fraction=0.25, seed=9), 256)
  np.testing.assert_array_equal(reseeded.heldout, corpus.heldout)
  assert "10 files" in corpus.description


def test_stdlib_read_cap_takes_whole_files_in_order(tmp_path):
  _write_tree(tmp_path, {f"m{i}.py": "x = 1\n" * 10 for i in range(6)})   # 60 bytes each
  corpus = data.load_corpus(DataConfig(kind="stdlib", path=str(tmp_path), heldout_fraction=0.4),
                            256, max_bytes=250)
  assert corpus.train.size + corpus.heldout.size == 4 * 61


def test_eval_batches_are_fixed_heldout_windows():
  corpus = _counting_corpus()
  batches = data.make_eval_batches(corpus, seq_len=SEQ, batch_size=4, num_batches=3)
  assert len(batches) == 3
  _assert_batches_equal(batches, data.make_eval_batches(corpus, seq_len=SEQ, batch_size=4,
                                                        num_batches=3))
  starts = set()
  for batch in batches:
    assert batch["inputs"].shape == (4, SEQ) and batch["inputs"].dtype == np.int32
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert (batch["inputs"] >= corpus.heldout[0]).all()    # never a training token
    starts |= {int(row[0]) for row in batch["inputs"]}
  assert len(starts) == 12                                   # distinct windows
  halves = [data.make_eval_batches(corpus, seq_len=SEQ, batch_size=4, num_batches=3,
                                   process_index=i, process_count=2) for i in range(2)]
  np.testing.assert_array_equal(
      np.concatenate([halves[0][0]["inputs"], halves[1][0]["inputs"]]), batches[0]["inputs"])


@pytest.mark.parametrize("dtype,vocab", [("uint16", 60_000), ("uint32", 100_000)])
def test_token_file_is_memory_mapped_and_split_at_the_tail(tmp_path, dtype, vocab):
  tokens = np.random.default_rng(0).integers(0, vocab, size=1000).astype(dtype)
  path = tmp_path / f"tokens.{dtype}"
  tokens.tofile(path)
  corpus = data.load_corpus(DataConfig(kind="tokens", path=str(path), token_dtype=dtype,
                                       heldout_fraction=0.1), vocab)
  assert isinstance(corpus.train, np.memmap) and corpus.train.dtype == np.dtype(dtype)
  assert corpus.heldout.size == 100
  np.testing.assert_array_equal(np.concatenate([corpus.train, corpus.heldout]), tokens)
  batch = next(data.make_train_iterator(corpus, seq_len=16, global_batch=2, seed=0))
  start = int(np.flatnonzero((np.lib.stride_tricks.sliding_window_view(tokens, 16)
                              == batch["inputs"][0]).all(axis=1))[0])
  np.testing.assert_array_equal(batch["targets"][0], tokens[start + 1:start + 17])


def test_synthetic_is_deterministic_in_range_and_seed_independent():
  a = data.load_corpus(DataConfig(kind="synthetic", seed=0), 300, synthetic_tokens=5000)
  b = data.load_corpus(DataConfig(kind="synthetic", seed=1), 300, synthetic_tokens=5000)
  np.testing.assert_array_equal(a.train, b.train)
  np.testing.assert_array_equal(a.heldout, b.heldout)
  assert a.train.size + a.heldout.size == 5000 and a.heldout.size == 100
  assert a.train.max() < 300 and a.train.min() >= 0 and a.train.max() > 255
  batch = next(data.make_train_iterator(a, seq_len=SEQ, global_batch=2, seed=0))
  assert ((batch["inputs"] >= 0) & (batch["inputs"] < 300)).all()


def test_stdlib_of_this_machine_is_python_source():
  corpus = data.load_corpus(DataConfig(), 256)
  assert corpus.train.dtype == np.uint8 and corpus.train.size > 1_000_000
  assert corpus.heldout.size > 10_000
  assert data.stdlib_folder() in corpus.description
  assert "def " in data.decode(corpus.train[:200_000])
  assert "import " in data.decode(corpus.heldout)


def test_decode_bytes_utf8_and_out_of_range():
  text = "def f(x):  # héllo ✓\n"
  assert data.decode(np.frombuffer(text.encode(), np.uint8)) == text
  assert data.decode([104, 105, 300, -1]) == "hi\ufffd\ufffd"


@pytest.mark.parametrize("case", [
    "tokens_no_path", "tokens_missing_file", "tokens_empty_file", "tokens_ragged_size",
    "tokens_above_vocab", "stdlib_missing_folder", "stdlib_no_py", "stdlib_only_empty_py",
    "stdlib_small_vocab", "too_short_for_train", "too_short_for_eval", "batch_vs_processes",
])
def test_config_errors(tmp_path, case):
  field = {"tokens_above_vocab": "model.vocab_size", "stdlib_small_vocab": "model.vocab_size",
           "too_short_for_train": "model.seq_len", "too_short_for_eval": "model.seq_len",
           "batch_vs_processes": "train.global_batch"}.get(case, "data.path")
  token_file = tmp_path / "t.bin"
  tokens = lambda **kw: DataConfig(kind="tokens", path=str(token_file), **kw)
  stdlib = DataConfig(kind="stdlib", path=str(tmp_path / "src"))
  (tmp_path / "src").mkdir()
  with pytest.raises(ConfigError) as raised:
    if case == "tokens_no_path":
      data.load_corpus(DataConfig(kind="tokens"), 256)
    elif case == "tokens_missing_file":
      data.load_corpus(tokens(), 256)
    elif case == "tokens_empty_file":
      token_file.write_bytes(b"")
      data.load_corpus(tokens(), 256)
    elif case == "tokens_ragged_size":
      token_file.write_bytes(b"\x01\x00\x02")
      data.load_corpus(tokens(), 256)
    elif case == "tokens_above_vocab":
      np.array([1, 2, 256, 3], np.uint16).tofile(token_file)
      data.load_corpus(tokens(), 256)
    elif case == "stdlib_missing_folder":
      data.load_corpus(DataConfig(kind="stdlib", path=str(tmp_path / "nowhere")), 256)
    elif case == "stdlib_no_py":
      (tmp_path / "src" / "notes.txt").write_text("no python here\n")
      data.load_corpus(stdlib, 256)
    elif case == "stdlib_only_empty_py":
      for i in range(60):
        (tmp_path / "src" / f"m{i}.py").write_text("")
      data.load_corpus(stdlib, 256)
    elif case == "stdlib_small_vocab":
      data.load_corpus(DataConfig(), 128)
    elif case == "too_short_for_train":
      data.make_train_iterator(_counting_corpus(num_tokens=SEQ), seq_len=SEQ, global_batch=2,
                               seed=0)
    elif case == "too_short_for_eval":
      data.make_eval_batches(_counting_corpus(), seq_len=200, batch_size=2, num_batches=1)
    elif case == "batch_vs_processes":
      data.make_train_iterator(_counting_corpus(), seq_len=SEQ, global_batch=5, seed=0,
                               process_count=2)
  assert raised.value.field == field


def _assert_same_corpus(a, b):
  np.testing.assert_array_equal(a.train, b.train)
  np.testing.assert_array_equal(a.heldout, b.heldout)
  assert a.description == b.description and a.train.dtype == b.train.dtype


def test_stdlib_tokens_cached_are_reused_until_a_file_changes(tmp_path):
  rng = np.random.default_rng(7)
  text = lambda: "".join(rng.choice(list("abc xyz\n()=:"), size=int(rng.integers(20, 200))))
  source, cache = tmp_path / "src", str(tmp_path / "cache")
  _write_tree(source, {f"pkg/m{i:02d}.py": text() for i in range(12)})
  config = DataConfig(kind="stdlib", path=str(source), heldout_fraction=0.25)
  scanned = data.load_corpus(config, 256)
  first = data.load_corpus(config, 256, cache_dir=cache)
  _assert_same_corpus(first, scanned)
  (entry,) = [f for f in os.listdir(cache)]
  # Same size and modification time, other bytes: the cache cannot tell, so it is served.
  path = source / "pkg" / "m03.py"
  stat = path.stat()
  path.write_text("q" * stat.st_size)
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  _assert_same_corpus(data.load_corpus(config, 256, cache_dir=cache), scanned)
  # An edited file (a new modification time) is read again, as is a new split.
  path.write_text(text())
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
  edited = data.load_corpus(config, 256, cache_dir=cache)
  _assert_same_corpus(edited, data.load_corpus(config, 256))
  assert not np.array_equal(edited.train, scanned.train) or \
      not np.array_equal(edited.heldout, scanned.heldout)
  assert entry not in os.listdir(cache) and len(os.listdir(cache)) == 1   # old one dropped
  split = DataConfig(kind="stdlib", path=str(source), heldout_fraction=0.5)
  _assert_same_corpus(data.load_corpus(split, 256, cache_dir=cache), data.load_corpus(split, 256))


def test_a_torn_stdlib_cache_entry_is_read_again_and_rewritten(tmp_path, caplog):
  _write_tree(tmp_path / "src", {f"m{i}.py": f"x = {i}\n" * (i + 1) for i in range(8)})
  config = DataConfig(kind="stdlib", path=str(tmp_path / "src"), heldout_fraction=0.25)
  cache = tmp_path / "cache"
  scanned = data.load_corpus(config, 256, cache_dir=str(cache))
  (entry,) = cache.iterdir()
  entry.write_bytes(entry.read_bytes()[:40])
  _assert_same_corpus(data.load_corpus(config, 256, cache_dir=str(cache)), scanned)
  assert "could not read" in caplog.text
  _assert_same_corpus(data.load_corpus(config, 256, cache_dir=str(cache)), scanned)
