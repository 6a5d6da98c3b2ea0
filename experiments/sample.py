r"""Text from a checkpoint: continue a prompt with the trained model, using a key/value cache.

  python -m experiments.sample --workdir=runs/gpt_tiny-20261123-150000 --prompt="def "
  python -m experiments.sample --workdir=RUN --prompt="import os" --temperature=0 \
      --max_new_tokens=100
  python -m experiments.sample --workdir=RUN --prompt="17 4 250" --tokenizer=ids

Loads the newest checkpoint in WORKDIR/checkpoints (or --step) onto one local device, whatever
mesh it was trained on. Text goes through the run's tokenizer: for a run on prepared data the
tokenizer it recorded (WORKDIR/data/tokenizer.json, else the one at its data.path), for the
stdlib corpus bytes. The prompt is read as the start of a document (the end-of-document token
comes first) and generation stops at the end of a document. Runs on other data take and print
token ids. Generated text goes to stdout, what was loaded and how fast it ran to stderr. A
missing workdir or checkpoint, or a prompt outside the model's vocabulary, prints one line and
exits with status 2.
"""
import os
import sys
import time

import numpy as np
from absl import app, flags
from absl import logging as absl_logging

from mscale_jax.errors import ConfigError

_WORKDIR = flags.DEFINE_string("workdir", None, "Run folder written by experiments/train.py "
                               "(or one run of experiments/convergence.py).", required=True)
_PROMPT = flags.DEFINE_string("prompt", "", "Text to continue, or token ids separated by "
                              "spaces or commas (--tokenizer=ids).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 100, "How many tokens to generate at most.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 is greedy "
                                  "(deterministic).")
_TOP_K = flags.DEFINE_integer("top_k", 40, "Sample among the k most likely tokens; 0: all.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed of the sampling.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
_TOKENIZER = flags.DEFINE_string("tokenizer", "auto", "auto: the run's own (prepared data: "
                                 "its BPE tokenizer; stdlib: bytes; other data: token ids), or "
                                 "'bytes', 'ids', or the path of a tokenizer.json.")


def run_tokenizer(workdir: str, meta: dict, vocab_size: int):
  """The tokenizer to read the prompt and write the text with; None for token ids.

  Checkpoints written before the data config was saved count as bytes if vocab_size == 256.
  """
  from mscale_jax import data
  from mscale_jax.text.tokenizer import BPETokenizer, ByteTokenizer
  choice = _TOKENIZER.value
  if choice == "ids":
    return None
  if choice == "bytes":
    return ByteTokenizer(data.SEPARATOR)
  if choice != "auto":
    return BPETokenizer.from_file(choice)
  if "data" not in meta:
    return ByteTokenizer(data.SEPARATOR) if vocab_size == 256 else None
  return data.run_tokenizer(workdir, meta["data"])


def encode(prompt: str, tokenizer) -> list[int]:
  """The prompt's tokens: the end-of-document token then the text's, or its listed ids."""
  if tokenizer is not None:
    return [tokenizer.eod] + tokenizer.encode(prompt)
  try:
    return [int(t) for t in prompt.replace(",", " ").split()]
  except ValueError:
    raise ConfigError("--prompt", prompt, "token ids (integers) separated by spaces or commas "
                      "for --tokenizer=ids") from None


def main(argv):
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)    # orbax's INFO chatter
  try:
    workdir = _WORKDIR.value
    if not os.path.isdir(workdir):
      raise ConfigError("--workdir", workdir, "an existing run folder")
    checkpoints = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(checkpoints) or not os.listdir(checkpoints):
      raise ConfigError("--workdir", workdir, "a run folder with a checkpoint in its "
                        "checkpoints/ (none there)")
    from mscale_jax import generate
    config, params, step, meta = generate.restore_params(checkpoints, _STEP.value)
    tokenizer = run_tokenizer(workdir, meta, config.vocab_size)
    prompt = encode(_PROMPT.value, tokenizer)
    top_k = _TOP_K.value or None
    generate.check_request(config, np.asarray(prompt), _MAX_NEW.value,
                           _TEMPERATURE.value, top_k)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  start = time.perf_counter()
  out = generate.generate(config, params, prompt, max_new_tokens=_MAX_NEW.value,
                          temperature=_TEMPERATURE.value, top_k=top_k, seed=_SEED.value,
                          stop_token=tokenizer.eod if tokenizer is not None else None)
  seconds = time.perf_counter() - start
  new = out.tokens[len(prompt):]
  print(f"[sample] {workdir} step {step}: {config.num_layers} layers, d={config.hidden}, "
        f"{config.block} block, window {config.attention_window}; {new.size} new tokens in "
        f"{seconds:.1f} s (compilation included), temperature {_TEMPERATURE.value}, top_k "
        f"{top_k or 'all'}; tokenizer: {tokenizer.description if tokenizer else 'token ids'}",
        file=sys.stderr)
  if tokenizer is not None:
    text = out.tokens[1:]                              # without the leading end-of-document
    if text.size and text[-1] == tokenizer.eod:
      text = text[:-1]
    print(tokenizer.decode(text))
  else:
    print(" ".join(map(str, out.tokens.tolist())))


if __name__ == "__main__":
  app.run(main)
