"""Training on prepared data: held-out documents, segment ids, the document mask, exact resume,
sampling with the run's tokenizer, and bad prepared folders refused in one line.

The corpus is built so that every letter says which document it came from (document i is
written only in the letters chr(97 + i) and chr(65 + i), with spaces and newlines), so any
token's text names its document, whatever the trained tokenizer merged.
"""
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from mscale_jax import data
from mscale_jax import mesh as mesh_lib
from mscale_jax.config import ModelConfig
from mscale_jax.errors import ConfigError
from mscale_jax.model import GPT
from mscale_jax.text import prepare, sources
from mscale_jax.text.tokenizer import BPETokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_DOCS = 26
VOCAB = 300


def _document(i: int, rng) -> str:
  letters = [chr(97 + i), chr(65 + i)]
  words = ["".join(rng.choice(letters, size=int(rng.integers(1, 6))))
           for _ in range(int(rng.integers(30, 90)))]
  return "".join(w + rng.choice([" ", " ", "\n"]) for w in words)


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
  """(prepared folder, manifest, tokenizer, {token id: the documents its text comes from})."""
  root = tmp_path_factory.mktemp("labelled")
  rng = np.random.default_rng(4)
  for i in range(NUM_DOCS):
    (root / f"doc{i:02d}.txt").write_text(_document(i, rng))
  out = str(root / "prepared")
  manifest = prepare.prepare([str(root)], out, prepare.PrepareOptions(
      vocab_size=VOCAB, heldout_fraction=0.2, seed=2), sources.ReadOptions(glob="*.txt"),
      show_progress=False).manifest
  tokenizer = BPETokenizer.from_file(os.path.join(out, "tokenizer.json"))
  docs_of = {t: {(ord(c.lower()) - 97) for c in tokenizer.decode([t]) if c.isalpha()}
             for t in range(tokenizer.vocab_size) if t != tokenizer.eod}
  docs_of[tokenizer.eod] = set()                # its name's letters belong to no document
  return out, manifest, tokenizer, docs_of


def _docs(tokens, docs_of) -> set[int]:
  return set().union(*(docs_of[int(t)] for t in np.asarray(tokens).reshape(-1)))


def _config(tiny_config, out, **sections):
  sections.setdefault("data", {})
  sections["data"] = dict(kind="prepared", path=out, document_mask=True, **sections["data"])
  return tiny_config(model=dict(vocab_size=VOCAB, num_layers=2, hidden=32, num_heads=4,
                                mlp_dim=64, seq_len=32, attention_window=8), **sections)


def test_heldout_documents_never_reach_a_training_window(labelled, tiny_config, tmp_path):
  """The Trainer's own iterator, past one epoch, and its own evaluation batches."""
  from mscale_jax.train import Trainer
  out, manifest, tokenizer, docs_of = labelled
  config = _config(tiny_config, out, mesh=dict(data=1, tensor=1),
                   train=dict(global_batch=4, eval_batches=4))
  trainer = Trainer(config, str(tmp_path), devices=jax.devices()[:1], show_progress=False)
  windows = data.num_windows(trainer.corpus.train, 32)
  train_docs, rows = set(), 0
  for _ in range(windows // 4 + 2):
    batch = next(trainer.train_iter)
    train_docs |= _docs(batch["inputs"], docs_of) | _docs(batch["targets"], docs_of)
    rows += batch["inputs"].shape[0]
    _check_segments(batch, tokenizer.eod, docs_of)
  trainer.train_iter.close()
  eval_docs = set()
  for batch in trainer.eval_batches:
    eval_docs |= _docs(batch["inputs"], docs_of) | _docs(batch["targets"], docs_of)
    _check_segments(batch, tokenizer.eod, docs_of)
  assert rows > windows
  assert train_docs.isdisjoint(eval_docs)
  assert len(eval_docs) == manifest["splits"]["heldout"]["documents"] >= 2
  assert train_docs | eval_docs == set(range(NUM_DOCS))


def _check_segments(batch, eod, docs_of):
  """Segment ids go up by one exactly at each end-of-document token; a segment holds one
  document's text."""
  inputs, segments = batch["inputs"], batch["segment_ids"]
  assert segments.dtype == np.int32 and segments.shape == inputs.shape
  steps = np.diff(segments, axis=1, prepend=0)
  np.testing.assert_array_equal(steps, (inputs == eod).astype(np.int32))
  for row, seg in zip(inputs, segments):
    for s in np.unique(seg):
      assert len(_docs(row[seg == s], docs_of)) <= 1


@pytest.mark.parametrize("window", [None, 4])
def test_document_mask_keeps_attention_inside_documents(window):
  """With rotary positions a document's logits do not depend on where its segment starts, so
  document B after document A (masked) must give B's logits alone; unmasked it does not.
  Run sequence- and tensor-parallel (data 2, tensor 4)."""
  config = ModelConfig(vocab_size=64, num_layers=2, hidden=32, num_heads=4, mlp_dim=64,
                       seq_len=16, positions="rotary", attention_window=window)
  with nnx.use_eager_sharding(False):
    graphdef, state = nnx.split(GPT(config, rngs=nnx.Rngs(0)))
  mesh = mesh_lib.make_mesh(dict(data=2, fsdp=1, stage=1, tensor=4))
  forward = jax.jit(lambda s, x, seg: nnx.merge(graphdef, s)(x, seg))
  rng = np.random.default_rng(0)
  a, b, c = (rng.integers(1, 64, size=(2, n)) for n in (5, 11, 5))
  after = np.concatenate([a, b], axis=1)                 # B at positions 5..15
  first = np.concatenate([b, c], axis=1)                 # B at positions 0..10
  seg_after = np.repeat([[0] * 5 + [1] * 11], 2, axis=0)
  seg_first = np.repeat([[0] * 11 + [1] * 5], 2, axis=0)
  with jax.set_mesh(mesh):
    masked = np.asarray(forward(state, after, seg_after))[:, 5:]
    alone = np.asarray(forward(state, first, seg_first))[:, :11]
    unmasked = np.asarray(forward(state, after, None))[:, 5:]
  np.testing.assert_allclose(masked, alone, atol=2e-5, rtol=2e-5)
  assert np.abs(unmasked - alone).max() > 1e-3


def test_document_mask_needs_documents_and_an_attention_that_takes_segments(tiny_config):
  from mscale_jax.config import validate
  base = dict(kind="prepared", path="x", document_mask=True)
  cases = [(dict(data=dict(kind="tokens", path="t.bin", document_mask=True)),
            "data.document_mask"),
           (dict(data=base, model=dict(attention_impl="pallas")), "model.attention_impl"),
           (dict(data=base, mesh=dict(data=4, stage=2, tensor=1),
                 pipeline=dict(microbatches=1)), "mesh.stage")]
  for sections, field in cases:
    with pytest.raises(ConfigError) as raised:
      validate(tiny_config(**sections), 8)
    assert raised.value.field == field


@pytest.mark.slow   # a whole trainer run or two: the full suite, not the fast tier
def test_resume_on_prepared_data_is_exact(labelled, tiny_config, tmp_path):
  """6 steps straight == 3 steps, a restart, 3 more: same bits and the same data position;
  the run records its tokenizer and manifest, and sampling reads text with them."""
  from mscale_jax.train import Trainer
  out, manifest, tokenizer, _ = labelled
  config = _config(tiny_config, out, train=dict(steps=6, log_every=1, eval_every=6,
                                                checkpoint_every=3))
  straight = Trainer(config, tmp_path / "straight", show_progress=False)
  straight.train()
  Trainer(config, tmp_path / "resumed", show_progress=False).train(stop_at=3)
  second = Trainer(config, tmp_path / "resumed", show_progress=False)
  assert second.train()["start_step"] == 3
  for x, y in zip(jax.tree.leaves(straight.final_state["params"]),
                  jax.tree.leaves(second.final_state["params"])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert straight.train_iter.get_state() == second.train_iter.get_state()
  state = second.train_iter.get_state()
  assert state["corpus"] == manifest["splits"]["train"]["sha256"]
  with pytest.raises(ConfigError, match="data.path"):
    second.train_iter.set_state(dict(state, corpus="0" * 64))   # another prepared corpus

  recorded = tmp_path / "resumed" / "data"
  assert (recorded / "tokenizer.json").read_bytes() == open(
      os.path.join(out, "tokenizer.json"), "rb").read()
  assert json.loads((recorded / "manifest.json").read_text()) == dict(manifest,
                                                                     prepared_folder=out)
  result = _run("experiments.sample", f"--workdir={tmp_path / 'resumed'}", "--prompt=aA a",
                "--max_new_tokens=6", "--temperature=0")
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith("aA a")
  assert f"BPE ({recorded / 'tokenizer.json'}, vocabulary {VOCAB})" in result.stderr


def _run(module, *args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case,message", [
    ("checksum", "SHA-256 of heldout.bin"),
    ("vocab", "model.vocab_size=256 is invalid: at least 300"),
])
def test_bad_prepared_folder_is_one_line_and_exit_2(labelled, tmp_path, case, message):
  out = labelled[0]
  vocab = {"checksum": VOCAB, "vocab": 256}[case]
  if case == "checksum":
    shutil.copytree(out, tmp_path / "copy")
    out = str(tmp_path / "copy")
    with open(os.path.join(out, "heldout.bin"), "r+b") as f:
      f.write(b"\x07\x00")
  result = _run("experiments.train", "--config.data.kind=prepared", f"--config.data.path={out}",
                f"--config.model.vocab_size={vocab}", f"--workdir={tmp_path / 'run'}")
  assert result.returncode == 2, result.stderr[-3000:]
  lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(lines) == 1 and message in lines[0], result.stderr[-3000:]
  assert "Traceback" not in result.stderr
