"""Fused LAMB (Pallas) against `optax.lamb`: one optimizer step including `apply_updates`.

'full' is a 1.3B-parameter GPT pytree (hidden 2048, 24 layers stacked as with scan-over-layers,
vocabulary 50304), fp32. GB/s counts the bytes a perfect fused step must move: read g, m, v, p
and write m, v, p (28 bytes per parameter). Target on H100/H200: >= 1.5x faster than optax.lamb.
"""
import jax
import jax.numpy as jnp
import optax

from experiments.timing import relative_error, time_fn
from pallas_kernels.lamb import fused_lamb

HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}
BYTES_PER_PARAM = 28


def gpt_shapes(layers, hidden, vocab, mlp_ratio=4):
  """Parameter shapes of a GPT with stacked layers (biases, two norms per layer)."""
  mlp = mlp_ratio * hidden
  return {
      "embed": (vocab, hidden),
      "blocks": {
          "ln": {"scale": (layers, hidden), "bias": (layers, hidden)},
          "qkv": {"kernel": (layers, hidden, 3 * hidden), "bias": (layers, 3 * hidden)},
          "out": {"kernel": (layers, hidden, hidden), "bias": (layers, hidden)},
          "mlp_in": {"kernel": (layers, hidden, mlp), "bias": (layers, mlp)},
          "mlp_out": {"kernel": (layers, mlp, hidden), "bias": (layers, hidden)},
      },
      "final_ln": {"scale": (hidden,), "bias": (hidden,)},
  }


SIZES = {
    "tiny": dict(layers=2, hidden=64, vocab=256),
    "small": dict(layers=4, hidden=256, vocab=4096),
    "full": dict(layers=24, hidden=2048, vocab=50304),
}


def _random_tree(shapes, seed, scale=1.0):
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [scale * jax.random.normal(k, s, jnp.float32)
                                      for k, s in zip(keys, leaves)])


def _timed_step(tx, grads, params):
  """A no-argument step that donates and carries its own params and state, as a trainer does.

  Donation matters for the fused kernel: it updates the moments in place (aliased outputs),
  which without donation would cost XLA a copy of m and v per step.
  """
  def step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  step = jax.jit(step, donate_argnums=(1, 2))
  params = jax.tree.map(jnp.copy, params)
  carry = {"params": params, "state": tx.init(params)}

  def call():
    carry["params"], carry["state"] = step(grads, carry["state"], carry["params"])
    return carry["params"]
  return call


def _second_updates(tx, grads, params):
  """The updates of the second step from a fresh state (what the accuracy column compares):
  at the first, bias correction makes Adam's direction sign(g) whatever the moments' decay."""
  def two_steps(g, p):
    updates, state = tx.update(g, tx.init(p), p)
    p = optax.apply_updates(p, updates)
    return tx.update(jax.tree.map(lambda x: -0.5 * x + 1e-3, g), state, p)[0]
  return jax.jit(two_steps)(grads, params)


def run(size: str, warmup: int, repeats: int) -> dict:
  """Times one step of optax.lamb and fused_lamb on the `size` pytree."""
  shapes = gpt_shapes(**SIZES[size])
  params = _random_tree(shapes, 0)
  grads = _random_tree(shapes, 1, scale=1e-2)
  count = sum(p.size for p in jax.tree.leaves(params))
  mask = lambda tree: jax.tree.map(lambda p: p.ndim >= 2, tree)
  kwargs = dict(weight_decay=0.01, mask=mask)
  kind = jax.devices()[0].device_kind
  peak = next((v for k, v in HBM_BYTES_PER_S.items() if k in kind), None)
  rows, times = [], {}
  reference = None
  for impl, tx in (("optax.lamb", optax.lamb(1e-3, **kwargs)),
                   ("fused_lamb", fused_lamb(1e-3, **kwargs))):
    updates = _second_updates(tx, grads, params)
    reference = updates if reference is None else reference
    error = relative_error(updates, reference)
    del updates
    call = _timed_step(tx, grads, params)
    stats = time_fn(call, warmup=warmup, repeats=repeats)
    t = stats["median_s"]
    times[impl] = t
    gbps = BYTES_PER_PARAM * count / t / 1e9
    row = {"params": f"{count / 1e6:.1f}M", "leaves": len(jax.tree.leaves(params)),
           "impl": impl, "median_ms": t * 1e3, "calls": stats["calls"], "GB/s": gbps,
           "rel_err_vs_optax": error}
    if peak:
      row["hbm_frac"] = gbps * 1e9 / peak
    if impl == "fused_lamb":
      row["speedup_vs_optax"] = times["optax.lamb"] / t
    rows.append(row)
    del call
  notes = ["fp32 params and moments; step = update + apply_updates under one jit, params and "
           "optimizer state donated",
           f"GB/s = {BYTES_PER_PARAM} bytes/param (read g, m, v, p; write m, v, p) / time",
           "target: fused_lamb >= 1.5x faster than optax.lamb on H100/H200",
           "rel_err_vs_optax: worst ||u - u_optax|| / ||u_optax|| over the leaves of the second "
           "step's updates (both float32; the second step's gradients differ from the first's)"]
  if jax.devices()[0].platform == "cpu":
    notes.append("CPU: the Pallas kernel runs in the interpreter; times show interpreter "
                 "overhead, not kernel speed")
  return {"rows": rows, "notes": notes}
