"""The held-out split that convergence results are measured on never reaches a training batch.

The corpus is built so that every byte says which file it came from (file i is written only in
bytes 1 + 6i .. 6 + 6i; 0 is the file separator), then the Trainer's own training iterator is
run for more than an epoch and its own evaluation batches are read: no file may appear in both.
"""
import jax
import numpy as np
import pytest

from mscale_jax.data import SEPARATOR

NUM_FILES = 40
BYTES_PER_FILE = 6


def _file_ids(tokens: np.ndarray) -> set[int]:
  """The files that the byte tokens come from (separators belong to no file)."""
  tokens = np.asarray(tokens).reshape(-1)
  return set(((tokens[tokens != SEPARATOR] - 1) // BYTES_PER_FILE).tolist())


@pytest.fixture(scope="module")
def labelled_corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("labelled_stdlib")
  rng = np.random.default_rng(11)
  for i in range(NUM_FILES):
    alphabet = np.arange(1 + BYTES_PER_FILE * i, 1 + BYTES_PER_FILE * (i + 1), dtype=np.uint8)
    text = rng.choice(alphabet, size=int(rng.integers(100, 400)))
    (root / f"mod{i:02d}.py").write_bytes(text.tobytes())
  return str(root)


def test_heldout_files_never_reach_a_training_batch(labelled_corpus, tiny_config, tmp_path):
  from mscale_jax.train import Trainer
  config = tiny_config(mesh=dict(data=1, tensor=1),
                       data=dict(path=labelled_corpus, heldout_fraction=0.1),
                       train=dict(global_batch=4, eval_batches=6))
  trainer = Trainer(config, str(tmp_path), devices=jax.devices()[:1], show_progress=False)
  windows = (trainer.corpus.train.size - 1) // config.model.seq_len
  train_files, train_rows = set(), 0
  for _ in range(windows // config.train.global_batch + 2):    # past one epoch
    batch = next(trainer.train_iter)
    train_files |= _file_ids(batch["inputs"]) | _file_ids(batch["targets"])
    train_rows += batch["inputs"].shape[0]
  trainer.train_iter.close()
  eval_files = set()
  for batch in trainer.eval_batches:
    eval_files |= _file_ids(batch["inputs"]) | _file_ids(batch["targets"])
  assert train_rows > windows                      # every training window was drawn
  assert train_files.isdisjoint(eval_files)
  # Not vacuous: evaluation reads several files, training reads all the others.
  assert len(eval_files) >= 2
  assert train_files | eval_files == set(range(NUM_FILES))
