r"""Throughput of the prepare step (MB of text per second) on this machine -> results/.

  python -m experiments.prepare_bench                       # the stdlib sources, BPE 4,096
  python -m experiments.prepare_bench --threads=1,2,0 --vocab_size=8192
  python -m experiments.prepare_bench --threads=0 --copies=1,4   # memory as the corpus grows

Runs `mscale_jax.text.prepare` end to end (read, train byte-level BPE, encode, write, hash) on
real text that ships with the machine, once per thread count of the tokenizer's pool (each in a
fresh process, as `RAYON_NUM_THREADS` is read once; 0: all cores), and records for each: the
seconds of tokenizer training and of encoding, MB/s of UTF-8 text and tokens/s for the whole
step and for encoding alone, and the child's peak resident memory. `--copies=N` reads the input
N times over (N times the text, the same vocabulary): the step streams, so its peak memory
should not grow with N. The record names the CPU and its core count, and the load
average around each run (other processes on a shared machine slow it down) and the CPU
seconds the run used (all threads): MB per CPU second depends much less on that load than MB
per wall second does.
"""
import itertools
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile

from absl import app, flags

from experiments import results

_INPUT = flags.DEFINE_string("input", None, "Folder or file of documents (default: this "
                             "interpreter's standard library, *.py, without site-packages).")
_GLOB = flags.DEFINE_string("glob", "*.py", "File name pattern within --input.")
_VOCAB = flags.DEFINE_integer("vocab_size", 4096, "BPE vocabulary to train.")
_THREADS = flags.DEFINE_list("threads", ["1", "0"], "Tokenizer thread counts to measure "
                             "(0: all cores).")
_COPIES = flags.DEFINE_list("copies", ["1"], "How many times over to read the input (a larger "
                            "corpus of the same text).")
_CHILD = flags.DEFINE_bool("child", False, "Internal: run once in this process, print JSON.")
_OUT = flags.DEFINE_string("out", None, "Internal: the child's output folder.")


def _input() -> str:
  if _INPUT.value:
    return _INPUT.value
  import sysconfig
  return sysconfig.get_paths()["stdlib"]


def measure_once(out: str) -> dict:
  """One prepare run in this process: its figures."""
  from mscale_jax.text import prepare, sources
  options = prepare.PrepareOptions(vocab_size=_VOCAB.value, heldout_fraction=0.01,
                                   overwrite=True)
  read = sources.ReadOptions(glob=_GLOB.value, exclude=("site-packages", "dist-packages"))
  result = prepare.prepare([_input()] * int(_COPIES.value[0]), out, options, read,
                           show_progress=False)
  m = result.manifest
  mb = m["text_bytes"] / 1e6
  usage = resource.getrusage(resource.RUSAGE_SELF)
  cpu_s = usage.ru_utime + usage.ru_stime          # all threads, imports included
  return {"documents": m["documents"], "text_mb": mb, "tokens": m["tokens"],
          "cpu_s": cpu_s, "mb_per_cpu_s": mb / cpu_s, "vocab_size": m["vocab_size"],
          "tokenizer_s": result.tokenizer_s, "encode_s": result.encode_s, "total_s": result.total_s,
          "mb_per_s": mb / result.total_s, "encode_mb_per_s": mb / result.encode_s,
          "encode_tokens_per_s": m["tokens"] / result.encode_s,
          "peak_rss_mb": usage.ru_maxrss / 1024}


def _cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor() or "unknown"


def main(argv):
  del argv
  if _CHILD.value:
    print(json.dumps(measure_once(_OUT.value)))
    return
  rows = []
  for threads, copies in itertools.product(map(int, _THREADS.value), map(int, _COPIES.value)):
    env = dict(os.environ)
    env.pop("RAYON_NUM_THREADS", None)
    if threads:
      env["RAYON_NUM_THREADS"] = str(threads)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="prepare-bench-") as out:
      command = [sys.executable, "-m", "experiments.prepare_bench", "--child", f"--out={out}",
                 f"--input={_input()}", f"--glob={_GLOB.value}",
                 f"--vocab_size={_VOCAB.value}", f"--copies={copies}"]
      print(f"[prepare_bench] threads={threads or 'all'}, copies={copies} ...", flush=True)
      child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if child.returncode:
      sys.exit(f"child failed:\n{child.stderr[-3000:]}")
    # The 1-minute load average around the run: on a shared machine, others' work shows here.
    row = {"threads": threads or os.cpu_count(), "copies": copies,
           **json.loads(child.stdout.splitlines()[-1]),
           "load_average_before": load_before, "load_average_after": os.getloadavg()[0]}
    rows.append(row)
    print(f"  {row['text_mb']:.1f} MB, {row['documents']:,} documents -> {row['tokens']:,} "
          f"tokens: tokenizer {row['tokenizer_s']:.1f} s, encode {row['encode_s']:.1f} s "
          f"({row['encode_mb_per_s']:.2f} MB/s, {row['encode_tokens_per_s']:,.0f} tok/s); "
          f"whole step {row['mb_per_s']:.2f} MB/s, {row['mb_per_cpu_s']:.2f} MB per CPU s; "
          f"peak RSS {row['peak_rss_mb']:.0f} MB; load average "
          f"{row['load_average_before']:.1f} -> {row['load_average_after']:.1f}",
          flush=True)
  device = {"platform": "cpu", "cpu": _cpu_name(), "host_cpu_count": os.cpu_count(),
            "python_version": platform.python_version()}
  import tokenizers
  path = results.write_record("prepare_bench", rows, device=device, extra={
      "input": _input(), "glob": _GLOB.value, "tokenizers_version": tokenizers.__version__,
      "note": "MB are 1e6 bytes of UTF-8 text; whole step = reading, BPE training, encoding, "
              "writing and hashing; threads = RAYON_NUM_THREADS of the tokenizer's pool"})
  print(f"[prepare_bench] wrote {path}")


if __name__ == "__main__":
  app.run(main)
