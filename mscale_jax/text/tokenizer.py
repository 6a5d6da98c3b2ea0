"""Tokenizers: bytes (the stdlib corpus) and byte-level BPE (GPT-2's scheme, HF `tokenizers`).

Both map text to int ids and back and name an end-of-document token `eod`, which follows every
document in a token stream and so also starts a prompt. Byte-level BPE works on the UTF-8 bytes
of the text (pre-split GPT-2 style into words, numbers, punctuation and spaces), so it covers
every string, and decode(encode(text)) == text. A document's text that happens to spell the
end-of-document token is encoded as plain text: only the prepare step puts boundaries in.
"""
from collections.abc import Iterable, Sequence

import numpy as np

from mscale_jax.errors import ConfigError

EOD_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
BYTE_VOCAB = 256
MIN_BPE_VOCAB = BYTE_VOCAB + 1      # every byte, and the end-of-document token


class ByteTokenizer:
  """Token = byte value of the UTF-8 text (vocabulary 256); `eod` is a byte that text lacks."""

  vocab_size = BYTE_VOCAB
  description = "bytes (UTF-8, vocabulary 256)"

  def __init__(self, eod: int = 0):
    self.eod = eod

  def encode(self, text: str) -> list[int]:
    """The UTF-8 bytes of `text`."""
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    """Text of byte tokens; ids outside 0..255 and broken UTF-8 become U+FFFD."""
    ids = np.asarray(ids).reshape(-1).astype(np.int64)
    valid = (ids >= 0) & (ids < BYTE_VOCAB)
    if valid.all():
      return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
    pieces = [bytes([t]) if ok else "\ufffd".encode() for t, ok in zip(ids.tolist(), valid)]
    return b"".join(pieces).decode("utf-8", errors="replace")


class BPETokenizer:
  """A HF `tokenizers.Tokenizer` with an end-of-document token, as prepared folders hold it."""

  def __init__(self, tokenizer, eod_token: str = EOD_TOKEN, *, source: str = "trained"):
    eod = tokenizer.token_to_id(eod_token)
    if eod is None:
      raise ConfigError("--eod_token", eod_token, f"a token of the tokenizer ({source}); it "
                        f"has no such token (a GPT-2 style one has {EOD_TOKEN!r}, others "
                        f"'</s>' or '<eos>')")
    self._tokenizer = tokenizer
    # Text that spells a special token is split like any other text: a document boundary is
    # only ever the `eod` id the prepare step appends.
    self._tokenizer.encode_special_tokens = True
    self.eod = int(eod)
    self.eod_token = eod_token
    self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    self.description = f"BPE ({source}, vocabulary {self.vocab_size:,})"

  @classmethod
  def from_file(cls, path: str, eod_token: str = EOD_TOKEN, *,
                field: str = "--tokenizer") -> "BPETokenizer":
    """Loads a `tokenizer.json` (ours, or any HF tokenizer file)."""
    from tokenizers import Tokenizer
    try:
      tokenizer = Tokenizer.from_file(path)
    except Exception as e:   # tokenizers raises a bare Exception for missing or broken files
      raise ConfigError(field, path, f"a tokenizer.json that HF tokenizers can load "
                        f"({str(e).splitlines()[0][:200]})") from None
    return cls(tokenizer, eod_token, source=path)

  def encode(self, text: str) -> list[int]:
    """The ids of `text` (no special tokens added)."""
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """`encode` of each text, computed in parallel on all cores (the library's thread pool)."""
    # encode_batch_fast (tokenizers >= 0.21) skips the character offsets nobody here reads.
    encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
    encodings = encode(list(texts), add_special_tokens=False)
    return [e.ids for e in encodings]

  def decode(self, ids) -> str:
    """The text of `ids` (the end-of-document token is written out as its name)."""
    return self._tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                                  skip_special_tokens=False)

  def to_str(self) -> str:
    """The tokenizer as `tokenizer.json` text (deterministic for the same tokenizer)."""
    return self._tokenizer.to_str(pretty=True)

  def save(self, path: str) -> None:
    """Writes `tokenizer.json`."""
    with open(path, "w", encoding="utf-8") as f:
      f.write(self.to_str())


def check_bpe_vocab(vocab_size) -> None:
  """Raises ConfigError if byte-level BPE cannot have `vocab_size` tokens."""
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) \
      or vocab_size < MIN_BPE_VOCAB:
    raise ConfigError("--vocab_size", vocab_size, f"an integer >= {MIN_BPE_VOCAB} (256 byte "
                      f"tokens and the end-of-document token)")


def train_bpe(texts: Iterable[str], vocab_size: int, *,
              show_progress: bool = False) -> BPETokenizer:
  """Trains byte-level BPE with `vocab_size` tokens on `texts` (streamed, in order).

  The vocabulary is the end-of-document token (id 0), the 256 byte symbols and the merges
  learned from the texts' word counts; the library counts and merges in parallel. Training is
  deterministic: the same texts give the same `tokenizer.json`. A corpus with too few distinct
  words yields fewer merges, hence a smaller vocabulary than asked for.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  check_bpe_vocab(vocab_size)
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=show_progress)
  tokenizer.train_from_iterator(texts, trainer)
  return BPETokenizer(tokenizer, EOD_TOKEN, source="trained")
