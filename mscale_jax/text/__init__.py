"""From text to token files and back: sources, tokenizers, the prepare step, prepared folders.

  sources.py    documents streamed from text files, JSON Lines, Parquet, HF datasets on disk
  tokenizer.py  byte tokens (the stdlib corpus) and byte-level BPE (HF `tokenizers`)
  prepare.py    documents -> trained tokenizer -> train/held-out token files + manifest
  prepared.py   a prepared folder's manifest: read, check against its files, load for training

`experiments/prepare_data.py` is the command line of `prepare.py`; `mscale_jax.data` reads
prepared folders through `prepared.py` (`--config.data.kind=prepared`).
"""
