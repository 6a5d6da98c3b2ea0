r"""Benchmarks each Pallas kernel against its reference and writes a `results/` JSON record.

  python -m experiments.kernel_bench --kernel=flash_attention
  python -m experiments.kernel_bench --kernel=all --size=full      # on a GPU/TPU

Times are per call: the median of `--repeats` samples after `--warmup` runs, each sample
`calls` back-to-back calls (the row's `calls` column) ended by one device sync and lasting
>= ~20 ms, so dispatch and sync overhead do not count against sub-millisecond kernels
(experiments/timing.py). Every row carries its error against a reference. On CPU the
kernels run in the Pallas interpreter and the 8 simulated devices share the host's cores, so CPU
timings show interpreter and simulation overhead, never kernel speed or overlap.
"""
import importlib

from experiments.host_devices import simulate_cpu_devices

simulate_cpu_devices(8)

from absl import app, flags  # noqa: E402

KERNELS = ("collective_matmul", "flash_attention", "layer_norm", "lamb", "gemm", "quantize")

_KERNEL = flags.DEFINE_enum("kernel", "all", ("all",) + KERNELS, "Which kernel to benchmark.")
_SIZE = flags.DEFINE_enum("size", "auto", ("auto", "tiny", "small", "full"),
                          "Shape table: 'auto' is 'full' on GPU/TPU and 'small' on CPU.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed runs before timing (compile, caches).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed samples; the median is reported.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Folder for the JSON record (default results/).")


def format_table(rows: list[dict]) -> str:
  """Renders rows of dicts as an aligned text table (floats to 4 significant digits)."""
  if not rows:
    return "(no rows)"
  columns = list(dict.fromkeys(key for row in rows for key in row))
  def cell(value):
    return f"{value:.4g}" if isinstance(value, float) else str(value)
  cells = [[cell(row.get(c, "")) for c in columns] for row in rows]
  widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
  lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)),
           "  ".join("-" * w for w in widths)]
  lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
  return "\n".join(lines)


def resolve_size(size: str) -> str:
  import jax
  if size != "auto":
    return size
  return "small" if jax.devices()[0].platform == "cpu" else "full"


def main(argv):
  del argv
  import jax
  from experiments import results, timing
  size = resolve_size(_SIZE.value)
  kernels = KERNELS if _KERNEL.value == "all" else (_KERNEL.value,)
  platform = jax.devices()[0].platform
  print(f"[kernel_bench] {len(jax.devices())} x {jax.devices()[0].device_kind} ({platform}), "
        f"size={size}, warmup={_WARMUP.value}, repeats={_REPEATS.value}", flush=True)
  if platform == "cpu":
    print("[kernel_bench] CPU: kernels run in the Pallas interpreter on simulated devices that "
          "share the host's cores; these timings show overhead, not kernel speed or overlap.")
  for kernel in kernels:
    module = importlib.import_module(f"experiments.benchmarks.{kernel}")
    print(f"\n== {kernel} ==", flush=True)
    out = module.run(size=size, warmup=_WARMUP.value, repeats=_REPEATS.value)
    print(format_table(out["rows"]))
    for note in out.get("notes", []):
      print(f"note: {note}")
    path = results.write_record(f"kernel_bench-{kernel}", out["rows"], out_dir=_OUT_DIR.value,
                                extra={"size": size, "notes": out.get("notes", []),
                                       "warmup": _WARMUP.value, "repeats": _REPEATS.value,
                                       "min_sample_s": timing.MIN_SAMPLE_S,
                                       "max_calls": timing.MAX_CALLS})
    print(f"[kernel_bench] wrote {path}", flush=True)


if __name__ == "__main__":
  app.run(main)
