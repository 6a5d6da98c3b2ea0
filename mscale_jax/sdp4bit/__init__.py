"""SDP4Bit (Jia et al., NeurIPS 2024): 4-bit communication for sharded data parallelism.

`quant` (group-wise quantizer, Hadamard transform), `collectives` (qWD all-gather, TLq-HS
reduce-scatter, per device), `data_parallel` (the train step's gradient function and weight
all-gather), `wire` (the bytes each collective of a compiled program moves).
"""
