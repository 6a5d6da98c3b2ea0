"""Tests for pallas_kernels/collective_matmul.py on 8 simulated CPU devices.

What CPU can prove, and what these tests check:
  * numbers: every impl equals the plain-JAX reference (all_gather + dot, dot + psum_scatter),
    forward and `jax.grad`, fp32 and bf16; the rings on 2, 4 and 8 devices, 'xla' on 4 and 8;
  * 'pallas': the TPU interpreter with `detect_races=True` reports no race, and (negative
    control) does report one when the handshake is removed; the kernel's program order starts
    each ring step's DMA before the step's matmul and waits on it after;
  * 'ppermute': in the compiled (scheduled) HLO no all-gather / reduce-scatter / all-reduce is
    left, each collective-permute has a dot that neither feeds it nor reads it (so an async
    scheduler may overlap them) and permutes and dots interleave in the schedule. CPU
    collective-permutes are synchronous, so actual overlap needs GPU/TPU HLO (start/done).
Buffers stay far below the ~96 KiB at which the TPU interpreter was seen to hang.
"""
import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import _collective_ring_kernels as ring_pallas
from pallas_kernels import collective_matmul as cm
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _interp

AXIS = "t"


def _mesh(p):
  return jax.make_mesh((p,), (AXIS,), axis_types=(AxisType.Auto,), devices=jax.devices()[:p])


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _shapes(p, seed, row_tile):
  """Random non-square local shapes: m rows per device, k, n (and their full sizes)."""
  rng = np.random.RandomState(seed)
  m = int(rng.choice([1, 2])) * row_tile
  k = int(rng.choice([24, 40, 56]))
  n = int(rng.choice([8, 24, 40]))
  return m, k, n


def _inputs(p, m, k, n, dtype, seed):
  keys = jax.random.split(jax.random.key(seed), 4)
  normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
  return (normal(keys[0], (p * m, k)), normal(keys[1], (k, p * n)),      # all-gather matmul
          normal(keys[2], (p * m, p * k)), normal(keys[3], (p * k, n)))  # matmul reduce-scatter


def _both(p, impl, bidirectional=False, interpret=None):
  """Global fn (x1, w1, x2, w2) -> (all_gather_matmul, matmul_reduce_scatter) over a P-ring."""
  def body(x1, w1, x2, w2):
    if impl == "ref":
      f32 = lambda a: a.astype(jnp.float32)
      return (jax.lax.all_gather(f32(x1), AXIS, tiled=True) @ f32(w1),
              jax.lax.psum_scatter(f32(x2) @ f32(w2), AXIS, scatter_dimension=0, tiled=True))
    kw = dict(axis_name=AXIS, impl=impl, bidirectional=bidirectional, interpret=interpret)
    return cm.all_gather_matmul(x1, w1, **kw), cm.matmul_reduce_scatter(x2, w2, **kw)
  return jax.shard_map(body, mesh=_mesh(p), in_specs=(P(AXIS), P(None, AXIS), P(None, AXIS),
                                                      P(AXIS)),
                       out_specs=(P(None, AXIS), P(AXIS)))


def _cotangent(y):
  return jnp.sin(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))


def _value_and_grads(fn, args):
  """Outputs and gradients of a linear loss <y, c> with a fixed cotangent c.

  Linear, so bf16 errors in y do not leak into the cotangent (a sin(y) loss would amplify
  them) and the gradient check tests the backward collective matmuls themselves.
  """
  def loss(*a):
    y1, y2 = fn(*a)
    return (jnp.sum(y1.astype(jnp.float32) * _cotangent(y1)) +
            jnp.sum(y2.astype(jnp.float32) * _cotangent(y2))), (y1, y2)
  (_, outs), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
      *args)
  return outs, grads


# The two rings on 2, 4 and 8 devices, bidirectional on a subset (P=2 is the degenerate ring
# where both neighbours are the same device). 'xla' has no ring (one all-gather / one
# reduce-scatter, the same program for any P): once here, on 8 devices, and in bfloat16 on 4.
FAST_CASES = [("ppermute", 4, False), ("pallas", 4, False), ("xla", 8, False),
              ("ppermute", 8, True)]
CASES = FAST_CASES + [pytest.param(*case, marks=pytest.mark.slow) for case in [
    ("ppermute", 2, False), ("ppermute", 8, False), ("pallas", 2, False), ("pallas", 8, False),
    ("pallas", 2, True), ("pallas", 4, True)]]


def _numpy_reference(args):
  """Global-array truth in float64: y1 = x1 @ w1, y2 = x2 @ w2 and the gradients of
  <y1, c1> + <y2, c2>, which is what the two shard_mapped calls compute together."""
  x1, w1, x2, w2 = (np.asarray(a, np.float64) for a in args)
  y1, y2 = x1 @ w1, x2 @ w2
  c1, c2 = (np.asarray(_cotangent(jnp.zeros(y.shape)), np.float64) for y in (y1, y2))
  return (y1, y2), (c1 @ w1.T, x1.T @ c1, c2 @ w2.T, x2.T @ c2)


@pytest.mark.parametrize("impl,p,bidirectional", CASES)
def test_matches_reference_fp32(impl, p, bidirectional):
  m, k, n = _shapes(p, seed=p + 10 * bidirectional, row_tile=16 if bidirectional else 8)
  args = _inputs(p, m, k, n, jnp.float32, seed=p)
  outs, grads = _value_and_grads(_both(p, impl, bidirectional), args)
  ref_outs, ref_grads = _numpy_reference(args)
  assert outs[0].shape == (p * m, p * n) and outs[1].shape == (p * m, n)
  for got, want in zip(outs + grads, ref_outs + ref_grads):
    assert got.dtype == jnp.float32 and _rel(got, want) < 1e-5


@pytest.mark.parametrize("impl,bidirectional", [
    ("pallas", False), pytest.param("xla", False, marks=pytest.mark.slow),
    pytest.param("ppermute", True, marks=pytest.mark.slow),
    pytest.param("pallas", True, marks=pytest.mark.slow)])
def test_matches_reference_bf16(impl, bidirectional):
  p = 4
  m, k, n = _shapes(p, seed=3, row_tile=32 if bidirectional else 16)
  args = _inputs(p, m, k, n, jnp.bfloat16, seed=5)
  outs, grads = _value_and_grads(_both(p, impl, bidirectional), args)
  ref_outs, ref_grads = _numpy_reference(args)
  for got, want in zip(outs + grads, ref_outs + ref_grads):
    assert got.dtype == jnp.bfloat16 and _rel(got, want) < 1e-2


def test_replicated_weight_gradient_is_summed():
  """A w replicated over the axis (P()) gets the psum of the per-device gradients."""
  p, m, k, n = 4, 8, 24, 40
  x = jax.random.normal(jax.random.key(0), (p * m, k))
  w = jax.random.normal(jax.random.key(1), (k, n))
  def make(impl):
    def body(x, w):
      y = (jax.lax.all_gather(x, AXIS, tiled=True) @ w if impl == "ref" else
           cm.all_gather_matmul(x, w, axis_name=AXIS, impl=impl))
      return jax.lax.psum(jnp.sum(jnp.sin(y)), AXIS)
    return jax.shard_map(body, mesh=_mesh(p), in_specs=(P(AXIS), P()), out_specs=P())
  for impl in ("xla", "ppermute"):
    got = jax.jit(jax.grad(make(impl), argnums=(0, 1)))(x, w)
    want = jax.jit(jax.grad(make("ref"), argnums=(0, 1)))(x, w)
    assert _rel(got[0], want[0]) < 1e-5 and _rel(got[1], want[1]) < 1e-5


# ---------------------------------------------------------------- pallas: races and order


def _run_pallas_kernel(kind, p, bidirectional, interpret):
  m, k, n = 16, 24, 40
  x1, w1, x2, w2 = _inputs(p, m, k, n, jnp.float32, seed=7)
  if kind == "ag":
    fn = jax.shard_map(functools.partial(cm.all_gather_matmul, axis_name=AXIS, impl="pallas",
                                         bidirectional=bidirectional, interpret=interpret),
                       mesh=_mesh(p), in_specs=(P(AXIS), P(None, AXIS)),
                       out_specs=P(None, AXIS))
    return jax.block_until_ready(jax.jit(fn)(x1, w1)), x1 @ w1
  fn = jax.shard_map(functools.partial(cm.matmul_reduce_scatter, axis_name=AXIS,
                                       impl="pallas", bidirectional=bidirectional,
                                       interpret=interpret),
                     mesh=_mesh(p), in_specs=(P(None, AXIS), P(AXIS)), out_specs=P(AXIS))
  return jax.block_until_ready(jax.jit(fn)(x2, w2)), x2 @ w2


@pytest.mark.parametrize("kind", ["ag", "rs"])
@pytest.mark.parametrize("p,bidirectional,mode", [
    (4, False, "on_wait"), pytest.param(8, False, "eager", marks=pytest.mark.slow),
    (4, True, "eager")])
def test_pallas_no_races(kind, p, bidirectional, mode):
  """'eager' runs each DMA as soon as it starts, exposing write-after-read hazards that the
  default 'on_wait' (data moves when waited on) can hide."""
  got, want = _run_pallas_kernel(
      kind, p, bidirectional, pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode))
  # The interpreter keeps the race detector of the last kernel it ran in a module global.
  assert _interp.races is not None and not _interp.races.races_found
  assert _rel(got, want) < 1e-5


@pytest.mark.parametrize("kind", ["ag", "rs"])
def test_race_detector_catches_missing_handshake(monkeypatch, kind):
  """Negative control: with only the first step's handshake (every device has entered the
  kernel) and none after it, the detector must report the overwritten ring buffer."""
  real, calls = ring_pallas._handshake, []
  def first_only(axis_name, senders):
    calls.append(1)
    if len(calls) == 1:
      real(axis_name, senders)
  monkeypatch.setattr(ring_pallas, "_handshake", first_only)
  try:
    _run_pallas_kernel(kind, 4, False,
                       pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager"))
  except Exception:
    pltpu.reset_tpu_interpret_mode_state()   # the interpreter asks for this after a failure
    raise
  assert len(calls) == 3 and _interp.races.races_found


_EVENTS = {"semaphore_signal": "S", "semaphore_wait": "W", "dma_start": "start",
           "dot_general": "dot", "dma_wait": "wait"}


def _kernel_program_order(kind, p, bidirectional):
  """The kernel body's sequence of handshake / DMA / dot primitives, as tokens."""
  m, k, n = 16, 24, 40
  args = _inputs(p, m, k, n, jnp.float32, seed=0)
  fn = _both(p, "pallas", bidirectional, interpret=pltpu.InterpretParams())
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  kernels = {}
  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name == "pallas_call":
        kernels[eqn.params["name"]] = eqn.params["jaxpr"]
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jaxpr)
  name = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter"}[kind]
  body = kernels[name + ("_bidi" if bidirectional else "")]
  tokens = [_EVENTS[e.primitive.name] for e in body.eqns if e.primitive.name in _EVENTS]
  # A handshake is one signal per sender then one wait; a DMA wait is a send and a recv wait.
  text = " ".join(tokens)
  text = re.sub(r"(S )+W", "handshake", text)
  return re.sub(r"wait wait", "wait", text)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_pallas_program_order(bidirectional):
  """Each ring step: DMA of the next chunk (or of the previous partial sum) started before
  this step's matmul and waited on after it."""
  p = 4
  r = 2 if bidirectional else 1
  start, dot, wait = " ".join(["start"] * r), " ".join(["dot"] * r), " ".join(["wait"] * r)
  ag = _kernel_program_order("ag", p, bidirectional)
  step = f"handshake {start} {dot} {wait}"
  assert ag == " ".join([step] * (p - 1) + [dot])
  rs = _kernel_program_order("rs", p, bidirectional)
  first, middle, last = f"{dot} handshake {start}", f"{dot} {wait} handshake {start}", \
      f"{dot} {wait}"
  assert rs == " ".join([first] + [middle] * (p - 2) + [last])


# ---------------------------------------------------------------- ppermute: compiled HLO


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\S.*?\s([a-z][\w\-]*)\((.*)$")


def _parse_hlo(text):
  """{computation: [(name, opcode, operand names, called computations)]} in schedule order."""
  comps, current = {}, None
  for line in text.splitlines():
    head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head and "=" not in line.split("{")[0]:
      current = comps.setdefault(head.group(1), [])
      continue
    match = _INSTR.match(line)
    if current is None or not match:
      continue
    name, opcode, rest = match.groups()
    operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
    called = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", rest)
    current.append((name, opcode, operands, called))
  return comps


def _schedule(text):
  """Entry-computation schedule as (name, kind, ancestors) with kind 'cp', 'dot' or other."""
  comps = _parse_hlo(text)
  entry = re.search(r"^ENTRY\s+%?([\w.\-]+)", text, re.M).group(1)
  def has_dot(comp, seen=()):
    return any(op == "dot" or any(c not in seen and has_dot(c, seen + (c,)) for c in called)
               for _, op, _, called in comps.get(comp, []))
  ancestors, out = {}, []
  for name, opcode, operands, called in comps[entry]:
    ancestors[name] = set(operands).union(*(ancestors.get(o, set()) for o in operands))
    kind = ("cp" if opcode.startswith("collective-permute") else
            "dot" if opcode == "dot" or any(has_dot(c) for c in called) else opcode)
    out.append((name, kind, ancestors[name]))
  return comps, out


def _assert_ring_overlappable(text, num_permutes, interleaved):
  comps, sched = _schedule(text)
  opcodes = {op for instrs in comps.values() for _, op, _, _ in instrs}
  assert not opcodes & {"all-gather", "reduce-scatter", "all-reduce", "all-gather-start",
                        "all-reduce-start"}, opcodes
  cps = [(i, s) for i, s in enumerate(sched) if s[1] == "cp"]
  dots = [(i, s) for i, s in enumerate(sched) if s[1] == "dot"]
  assert len(cps) == num_permutes and len(dots) >= num_permutes
  for _, (cp_name, _, cp_anc) in cps:
    # Some dot neither feeds this permute nor reads its result: they may run concurrently.
    assert any(cp_name not in anc and name not in cp_anc for _, (name, _, anc) in dots)
  kinds = "".join("P" if s[1] == "cp" else "D" for s in sched if s[1] in ("cp", "dot"))
  if interleaved:
    assert "PP" not in kinds, kinds   # never two permutes without a dot between them
  return kinds


@pytest.mark.parametrize("bidirectional", [False, True])
def test_ppermute_hlo_is_overlappable(bidirectional):
  """Compiled CPU HLO of the 'ppermute' rings (P=4).

  All-gather: chunk s+1's permute is independent of chunk s's dot, and the schedule
  alternates permute, dot, permute, ... Reduce-scatter: every dot is independent of every
  permute (only the adds wait); XLA:CPU is free to, and does, hoist all dots before the
  permutes, so only the dependency structure is asserted. CPU permutes are synchronous: the
  async start/done pairs that make this overlap real appear only in GPU/TPU HLO.
  """
  p = 4
  x1, w1, x2, w2 = _inputs(p, 16, 24, 40, jnp.float32, seed=0)
  mesh = _mesh(p)
  kw = dict(axis_name=AXIS, impl="ppermute", bidirectional=bidirectional)
  ag = jax.jit(jax.shard_map(lambda x, w: cm.all_gather_matmul(x, w, **kw), mesh=mesh,
                             in_specs=(P(AXIS), P(None, AXIS)), out_specs=P(None, AXIS)))
  rs = jax.jit(jax.shard_map(lambda x, w: cm.matmul_reduce_scatter(x, w, **kw), mesh=mesh,
                             in_specs=(P(None, AXIS), P(AXIS)), out_specs=P(AXIS)))
  rings = 2 if bidirectional else 1
  # With two rings the two directions' permutes of one step may sit side by side.
  _assert_ring_overlappable(ag.lower(x1, w1).compile().as_text(), rings * (p - 1),
                            interleaved=not bidirectional)
  _assert_ring_overlappable(rs.lower(x2, w2).compile().as_text(), rings * (p - 1),
                            interleaved=False)


def _tp_layer(impl, mesh, axis_names):
  """Sequence-parallel MLP block: all-gather-matmul, tanh, matmul-reduce-scatter."""
  def body(x, w_in, w_out):
    b, s, d = x.shape
    rows = x.reshape(b * s, d)   # the layer is token-wise: any row order that RS undoes works
    if impl == "ref":
      h = jnp.tanh(jax.lax.all_gather(rows, "tensor", tiled=True) @ w_in)
      y = jax.lax.psum_scatter(h @ w_out, "tensor", scatter_dimension=0, tiled=True)
    else:
      h = jnp.tanh(cm.all_gather_matmul(rows, w_in, axis_name="tensor", impl=impl))
      y = cm.matmul_reduce_scatter(h, w_out, axis_name="tensor", impl=impl)
    return x + y.reshape(b, s, d)
  batch = "data" if "data" in axis_names else None
  return jax.shard_map(body, mesh=mesh, axis_names=axis_names,
                       in_specs=(P(batch, "tensor"), P(None, "tensor"), P("tensor")),
                       out_specs=P(batch, "tensor"))


def _tp_args(mesh, batch_sharded=True):
  b, s, d, f = 4, 32, 24, 64
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.device_put(jax.random.normal(keys[0], (b, s, d)),
                     NamedSharding(mesh, P("data" if batch_sharded else None, "tensor")))
  w_in = jax.device_put(jax.random.normal(keys[1], (d, f)) / 5,
                        NamedSharding(mesh, P(None, "tensor")))
  w_out = jax.device_put(jax.random.normal(keys[2], (f, d)) / 8,
                         NamedSharding(mesh, P("tensor")))
  return x, w_in, w_out


def _tp_step(layer):
  return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(layer(*a) ** 2), argnums=(0, 1, 2)))


@pytest.mark.parametrize("batch_sharded", [False, True])
def test_tp_layer_ppermute_has_no_monolithic_collective(batch_sharded):
  """Forward + backward of a TP layer with 'ppermute': only collective-permutes (P-1 per
  collective matmul: AG and RS forward, RS and AG backward), no all-gather/reduce-scatter;
  the 'xla' baseline of the same layer does have them.

  With the batch sharded over 'data' the shard_map makes 'data' manual too: left automatic,
  XLA's partitioner all-gathers over 'data' where the data-sharded batch is merged into the
  rows that the ring gathers over 'tensor' (for 'xla' as well as 'ppermute').
  """
  mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
  args = _tp_args(mesh, batch_sharded)
  axis_names = {"data", "tensor"} if batch_sharded else {"tensor"}
  ops = {}
  for impl in ("xla", "ppermute"):
    text = _tp_step(_tp_layer(impl, mesh, axis_names)).lower(*args).compile().as_text()
    ops[impl] = re.findall(r"=\s*\S+\s+([a-z][\w\-]*)\(", text)
  assert "all-gather" in ops["xla"] and "reduce-scatter" in ops["xla"]
  assert not {"all-gather", "reduce-scatter"} & set(ops["ppermute"])
  # Forward: AG + RS rings; backward: RS (dx of AG) + AG (dx of RS); 3 permutes each.
  assert ops["ppermute"].count("collective-permute") == 4 * 3


@pytest.mark.parametrize("impl", ["xla", "ppermute"])
@pytest.mark.parametrize("axis_names", [("tensor",), ("data", "tensor")])
def test_tp_layer_under_shard_map(impl, axis_names):
  """A ('data', 'tensor') = (2, 4) mesh of Auto axes, batch sharded over 'data', under jit
  and grad: with only 'tensor' manual (the TP layer's setting), and with both manual (w's
  gradient is then summed over 'data' by the custom_vjp)."""
  mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
  args = _tp_args(mesh)
  loss, grads = _tp_step(_tp_layer(impl, mesh, set(axis_names)))(*args)
  ref_loss, ref_grads = _tp_step(_tp_layer("ref", mesh, set(axis_names)))(*args)
  assert _rel(loss, ref_loss) < 1e-5
  for got, want in zip(grads, ref_grads):
    assert _rel(got, want) < 1e-5


def test_pallas_interpreter_needs_all_axes_manual():
  mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
  with pytest.raises(ValueError, match=r"every mesh axis manual.*\['data'\]"):
    _tp_step(_tp_layer("pallas", mesh, {"tensor"})).lower(*_tp_args(mesh))
  # With every axis manual the same layer runs in the interpreter and matches.
  x, w_in, w_out = _tp_args(mesh)
  full = jax.jit(_tp_layer("pallas", mesh, frozenset()))(x, w_in, w_out)
  ref = jax.jit(_tp_layer("ref", mesh, frozenset()))(x, w_in, w_out)
  assert _rel(full, ref) < 1e-5


# ---------------------------------------------------------------- errors


def _call(fn, x, w, p=4, in_specs=(P(AXIS), P()), **kw):
  wrapped = jax.shard_map(functools.partial(fn, axis_name=AXIS, **kw), mesh=_mesh(p),
                          in_specs=in_specs, out_specs=P(AXIS))
  return jax.eval_shape(wrapped, x, w)


@pytest.mark.parametrize("fn,x_shape,w_shape,kw,match", [
    (cm.matmul_reduce_scatter, (6, 8), (8, 16), {"impl": "xla"},
     r"x rows M=6 \(x \(6, 8\)\) must be divisible by the axis size P=4"),
    (cm.all_gather_matmul, (4 * 4, 8), (8, 16), {"impl": "pallas"},
     r"row tiles of 8 \(float32\): x rows m=4"),
    (cm.all_gather_matmul, (4 * 8, 8), (8, 16), {"impl": "pallas", "bidirectional": True},
     r"halved = 4 rows"),
    (cm.matmul_reduce_scatter, (12, 8), (8, 16), {"impl": "ppermute",
                                                         "bidirectional": True},
     r"M/P=3 .* must be even"),
    (cm.all_gather_matmul, (4 * 8, 8), (12, 16), {"impl": "xla"},
     r"contracting dims differ: x \(8, 8\)"),
    (cm.all_gather_matmul, (4 * 8, 8), (8, 16), {"impl": "cuda"}, r"impl='cuda' is invalid"),
    (cm.all_gather_matmul, (4 * 8, 8), (8, 16), {"impl": "xla", "bidirectional": True},
     r"bidirectional=True needs impl"),
    (cm.all_gather_matmul, (4 * 8, 8), (8, 16), {"impl": "pallas", "interpret": True},
     r"interpret=True is the generic Pallas interpreter"),
])
def test_shape_errors(fn, x_shape, w_shape, kw, match):
  in_specs = (P(None, AXIS) if fn is cm.matmul_reduce_scatter else P(AXIS), P())
  if fn is cm.matmul_reduce_scatter:
    x_shape = (x_shape[0], 4 * x_shape[1])
  with pytest.raises(ValueError, match=match):
    _call(fn, jnp.zeros(x_shape), jnp.zeros(w_shape), in_specs=in_specs, **kw)


def test_dtype_mismatch_error():
  with pytest.raises(ValueError, match=r"dtypes differ: x float32, w bfloat16"):
    _call(cm.all_gather_matmul, jnp.zeros((32, 8)), jnp.zeros((8, 16), jnp.bfloat16),
          impl="ppermute")


def test_outside_shard_map_error():
  with pytest.raises(ValueError, match=r"axis_name='t' is not a bound mesh axis.*shard_map"):
    cm.all_gather_matmul(jnp.zeros((8, 8)), jnp.zeros((8, 8)), axis_name=AXIS, impl="xla")
  with pytest.raises(ValueError, match=r"matmul_reduce_scatter: axis_name='t'"):
    jax.jit(functools.partial(cm.matmul_reduce_scatter, axis_name=AXIS, impl="pallas"))(
        jnp.zeros((8, 8)), jnp.zeros((8, 8)))
