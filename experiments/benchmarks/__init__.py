"""One module per kernel benchmark; `experiments/kernel_bench.py` runs them.

Each module defines `run(size: str, warmup: int, repeats: int) -> dict` returning
`{"rows": [dict, ...], "notes": [str, ...]}`: one row per (shape, implementation, pass) with the
median time and derived figures (TFLOP/s, GB/s, ratio to the reference). `size` is 'tiny'
(CI / notebooks), 'small' (CPU) or 'full' (accelerator shapes).
"""
