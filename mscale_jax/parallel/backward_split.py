"""Splits a backward pass into B (input gradient) and W (weight gradients), sharing the work.

Zero-bubble schedules (ZB-H1, Qi et al., ICLR 2024) run a chunk's backward as two passes: B,
the input gradient, on the critical path, and W, the weight gradients, later in a bubble. W
costs one forward's worth of matmuls only if it does not derive the cotangent chain again:
it multiplies what B computed (each weight matmul's output cotangent, and its input) into the
weight gradients. `split` does this for any traceable backward, on its jaxpr:

  B runs every equation the B outputs depend on, and returns, besides them, `saved`: the
  values B computed that W reads;
  W runs the remaining equations the W outputs depend on, from `saved` and the arguments.

What W reads of B's is kept in memory from B to W, so W runs cheap work again (elementwise
steps, an all-gather) where its inputs take no more bytes than the outputs it would read: of
a chain of elementwise steps B kept one value, of a gathered array the shard.

A scan (the model's layers) is split the same way inside: B's scan carries the cotangent chain
and emits per iteration what W's needs, W's scan (no carry) maps the weight-gradient matmuls
over those. Checkpoint regions are inlined; every other equation (jit calls, shard_map regions)
is atomic: in B when B needs any of its outputs, its other outputs then saved for W. Both
passes evaluate the traced equations as they are, so B and W together compute exactly what the
unsplit backward computes, its matmuls once.
"""
import dataclasses

import jax
from jax.extend import core
from jax.sharding import PartitionSpec as P

_CHECKPOINT = "remat2"


def split(fn, b_outputs: int, b_only: int = 0):
  """(b, w) for `fn(*args) -> outputs`, the first `b_outputs` of them B's, the rest W's.

  b(*args) -> (B outputs, saved: a list of arrays); w(saved, *args) -> W outputs. Outputs are
  flat lists of arrays (`fn`'s outputs flattened). W does not read the last `b_only` args
  (what B received and W will not have: give w zeros of their shape); what it needs of them
  comes in `saved`. b and w each trace `fn` (so each may run in its own `lax.switch` branch)
  and agree on `saved` for equal argument shapes.
  """
  def plan(args):
    closed = jax.make_jaxpr(lambda *a: jax.tree.leaves(fn(*a)))(*args)
    jaxpr, flat = closed.jaxpr, len(closed.jaxpr.outvars)
    hidden = len(jax.tree.leaves(args[len(args) - b_only:])) if b_only else 0
    readable = set(jaxpr.invars[:len(jaxpr.invars) - hidden])
    mask = [i < b_outputs for i in range(flat)]
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, jax.tree.leaves(args)))
    return env, _Plan.of(jaxpr, mask, [not b for b in mask], readable)

  def b(*args):
    env, p = plan(args)
    return _run_b(p, env)

  def w(saved, *args):
    env, p = plan(args)
    env.update(zip(p.saved, saved))
    return _run_w(p, env)
  return b, w


@dataclasses.dataclass
class _Plan:
  """Which equations of a jaxpr (checkpoints inlined) B and W run, and what W reads of B's.

  b_eqns / w_eqns: indices into `eqns`; nested: index -> (_Plan of the body, which outputs B
  computes) for every scan or shard_map B runs; saved: what W reads that B computes (a Var,
  or a key (index, k) for the k-th value a nested equation's B half keeps for its W half);
  b_invars / w_invars: the invars B / W read.
  """
  eqns: list
  outvars: list
  b_out: list
  w_out: list
  b_eqns: set
  nested: dict
  b_invars: set
  w_eqns: set = dataclasses.field(default_factory=set)
  saved: list = dataclasses.field(default_factory=list)
  w_invars: set = dataclasses.field(default_factory=set)

  @classmethod
  def of(cls, jaxpr, b_out, w_out, readable=None, redo_from=None):
    """The plan of `jaxpr`; W may read the invars in `readable` (default all) directly, and
    gets the others it needs (a scan body's carries) from B as saved values. W computes
    again what cheap equations (elementwise work) derive from the invars in `redo_from`
    (default `readable`) rather than keeping it from B in memory between the two passes."""
    eqns, outvars = _inline(jaxpr)
    live, b_eqns, masks = _mark_b(eqns, outvars, b_out)
    plan = cls(eqns, outvars, list(b_out), list(w_out), b_eqns, masks,
               {v for v in jaxpr.invars if v in live})
    readable = set(jaxpr.invars) if readable is None else readable
    plan._mark_w(readable, jaxpr.invars, readable if redo_from is None else redo_from)
    return plan

  def _mark_w(self, readable, invars, redo_from):
    live = {v for v, w in zip(self.outvars, self.w_out) if w and _is_var(v)}
    saved = []
    cheap = set(redo_from)
    for eqn in self.eqns:
      if _is_cheap(eqn) and all(a in cheap for a in eqn.invars if _is_var(a)):
        cheap.update(o for o in eqn.outvars if _is_var(o))

    def save(v):
      if v not in saved:
        saved.append(v)
    for i in reversed(range(len(self.eqns))):
      eqn = self.eqns[i]
      used = [o in live for o in eqn.outvars]
      recompute = i not in self.nested and (
          all(o in cheap for o, u in zip(eqn.outvars, used) if u)
          or _smaller_redone(eqn, used, lambda a: a in live or a in cheap or a in readable))
      if i not in self.b_eqns or recompute:
        if any(used):
          self.w_eqns.add(i)
          live.update(a for a in eqn.invars if _is_var(a))
        continue
      if i not in self.nested:
        for o, u in zip(eqn.outvars, used):
          if u:
            save(o)
        continue
      # W's half computes what W uses of it (keeping from B only what it cannot redo
      # cheaply), but a scan's carries: those come from B.
      b_mask, body = self.nested[i], _body(eqn)
      w_mask = list(used)
      for k in _NESTED[eqn.primitive.name].carries(eqn):
        if used[k]:
          save(eqn.outvars[k])
        w_mask[k] = False
      # In a body W may redo from every invar: a carry it reads (the layer's input, say) is
      # then kept from B instead of what the layer derives from it elementwise.
      sub = _Plan.of(body, b_mask, w_mask, _NESTED[eqn.primitive.name].readable(eqn, body),
                     set(body.invars))
      self.nested[i] = (sub, b_mask)
      if any(w_mask):
        self.w_eqns.add(i)
        live.update(a for a, v in zip(eqn.invars, body.invars)
                    if v in sub.w_invars and _is_var(a))
        for k in range(len(sub.saved)):
          save((i, k))
    for v in reversed(invars):    # in order: B and W trace separately and must agree
      if v in live and v in readable:
        self.w_invars.add(v)
      elif v in live:
        save(v)
    self.saved = list(reversed(saved))


# Equations W never runs again to spare a saved value: matmuls and communication.
_COSTLY = {"dot_general", "conv_general_dilated", "psum", "psum_invariant", "pmax", "pmin",
           "all_gather", "all_gather_invariant", "reduce_scatter", "psum_scatter", "ppermute",
           "all_to_all", "pallas_call"}


# Communication W runs again where that keeps less: an all-gather, whose input is a fraction
# of its output (the unsplit backward of a per-layer checkpoint gathers its input again too).
_REGATHER = {"all_gather", "all_gather_invariant"}


def _smaller_redone(eqn, used, free) -> bool:
  """Whether W redoes `eqn` (cheap, or an all-gather) rather than keep the outputs of it that
  it reads (`used`): the inputs W would not have anyway (`free(var)` false) take no more
  bytes than those outputs. So of a chain of elementwise steps B ran W keeps one value, not
  one per step, and of a gathered array the shard."""
  if not (_is_cheap(eqn) or eqn.primitive.name in _REGATHER):
    return False
  extra = {a for a in eqn.invars if _is_var(a) and not free(a)}
  return (sum(_nbytes(a) for a in extra)
          <= sum(_nbytes(o) for o, u in zip(eqn.outvars, used) if u))


def _nbytes(v) -> int:
  return v.aval.size * v.aval.dtype.itemsize


def _is_cheap(eqn) -> bool:
  return (eqn.primitive.name not in _COSTLY and eqn.primitive.name not in _NESTED
          and not list(core.jaxprs_in_params(eqn.params)))


def _mark_b(eqns, outvars, b_out) -> tuple:
  """(live variables, indices of the equations B runs, {nested equation's index: which of its
  outputs B computes}) for the outputs `b_out` marks."""
  live = {v for v, b in zip(outvars, b_out) if b and _is_var(v)}
  b_eqns, masks = set(), {}
  for i in reversed(range(len(eqns))):
    eqn = eqns[i]
    used = [o in live for o in eqn.outvars]
    if not any(used):
      continue
    b_eqns.add(i)
    if eqn.primitive.name in _NESTED:
      masks[i] = _NESTED[eqn.primitive.name].b_mask(eqn, used)
      body = _body(eqn)
      body_live = _mark_b(*_inline(body), masks[i])[0] | _NESTED[eqn.primitive.name].b_reads(
          eqn, body)
      live.update(a for a, v in zip(eqn.invars, body.invars) if v in body_live and _is_var(a))
    else:
      live.update(a for a in eqn.invars if _is_var(a))
  return live, b_eqns, masks


def _run_b(plan: _Plan, env: dict) -> tuple:
  """(B outputs, saved) of `plan`, its invars (and constvars) bound in `env`."""
  for i, eqn in enumerate(plan.eqns):
    if i not in plan.b_eqns:
      continue
    if i in plan.nested:
      sub, b_mask = plan.nested[i]
      outs, kept = _NESTED[eqn.primitive.name].run_b(eqn, sub, env)
      _write(env, [o for o, b in zip(eqn.outvars, b_mask) if b], outs)
      env.update({(i, k): x for k, x in enumerate(kept)})
    else:
      _write(env, eqn.outvars, _bind(eqn, [_read(env, a) for a in eqn.invars]))
  outs = [_read(env, v) for v, b in zip(plan.outvars, plan.b_out) if b]
  return outs, [env[v] for v in plan.saved]


def _run_w(plan: _Plan, env: dict) -> list:
  """W outputs of `plan`, its readable invars and its saved values bound in `env`."""
  for i, eqn in enumerate(plan.eqns):
    if i not in plan.w_eqns:
      continue
    if i in plan.nested:
      sub, _ = plan.nested[i]
      kept = [env[(i, k)] for k in range(len(sub.saved))]
      outs = _NESTED[eqn.primitive.name].run_w(eqn, sub, env, kept)
      _write(env, [o for o, w in zip(eqn.outvars, sub.w_out) if w], outs)
    else:
      _write(env, eqn.outvars, _bind(eqn, [_read(env, a) for a in eqn.invars]))
  return [_read(env, v) for v, w in zip(plan.outvars, plan.w_out) if w]


def _scan_counts(eqn) -> tuple[int, int]:
  """(consts, carries) of a scan equation: JAX 0.10 names the counts; 0.11 gives flat trees
  of (consts, carry, xs) as `ft_in`."""
  p = eqn.params
  if "num_carry" in p:
    return p["num_consts"], p["num_carry"]
  consts, carry, _ = p["ft_in"].unpack()
  return len(consts), len(carry)


def _body(eqn):
  j = eqn.params["jaxpr"]
  return getattr(j, "jaxpr", j)


def _body_env(eqn) -> dict:
  j = eqn.params["jaxpr"]
  return dict(zip(j.jaxpr.constvars, j.consts)) if hasattr(j, "jaxpr") else {}


def _reads(eqn, invars: set) -> list:
  """[(k, body invar)] of the body invars in `invars`."""
  return [(k, v) for k, v in enumerate(_body(eqn).invars) if v in invars]


class _Scan:
  """A scan: B's half carries the chain (every carry is B's) and emits per iteration what
  W's half reads, as extra ys; W's half (no carry) maps over those and the xs it reads."""

  @staticmethod
  def b_mask(eqn, used):
    n_carry = _scan_counts(eqn)[1]
    return [True] * n_carry + used[n_carry:]

  @staticmethod
  def carries(eqn):
    return range(_scan_counts(eqn)[1])

  @staticmethod
  def b_reads(eqn, body):   # every carry's initial value: W may read any iteration's carry
    n_consts, n_carry = _scan_counts(eqn)
    return set(body.invars[n_consts:n_consts + n_carry])

  @staticmethod
  def readable(eqn, body):   # consts and xs; a carry W reads comes from B
    n_consts, n_carry = _scan_counts(eqn)
    return {v for k, v in enumerate(body.invars) if not n_consts <= k < n_consts + n_carry}

  @staticmethod
  def run_b(eqn, sub, env):
    p, body = eqn.params, _body(eqn)
    n_consts, n_carry = _scan_counts(eqn)
    reads = _reads(eqn, sub.b_invars)
    consts = {v: _read(env, eqn.invars[k]) for k, v in reads if k < n_consts}
    xs = {v: _read(env, eqn.invars[k]) for k, v in reads if k >= n_consts + n_carry}
    carry_vars = body.invars[n_consts:n_consts + n_carry]
    init = [_read(env, a) for a in eqn.invars[n_consts:n_consts + n_carry]]

    def step(carry, x):
      inner = {**_body_env(eqn), **consts, **dict(zip(carry_vars, carry)), **dict(zip(xs, x))}
      outs, saved = _run_b(sub, inner)
      return outs[:n_carry], (outs[n_carry:], saved)
    carry, (ys, saved) = jax.lax.scan(step, init, list(xs.values()), length=p["length"],
                                      reverse=p["reverse"], unroll=p["unroll"])
    return list(carry) + list(ys), saved

  @staticmethod
  def run_w(eqn, sub, env, kept):
    p = eqn.params
    n_consts = _scan_counts(eqn)[0]
    reads = _reads(eqn, sub.w_invars)
    consts = {v: _read(env, eqn.invars[k]) for k, v in reads if k < n_consts}
    xs = {v: _read(env, eqn.invars[k]) for k, v in reads if k >= n_consts}

    def step(_, x):
      x_vals, saved = x
      inner = {**_body_env(eqn), **consts, **dict(zip(xs, x_vals)),
               **dict(zip(sub.saved, saved))}
      return (), _run_w(sub, inner)
    _, ys = jax.lax.scan(step, (), (list(xs.values()), kept), length=p["length"],
                         reverse=p["reverse"], unroll=p["unroll"])
    return ys


class _ShardMap:
  """A shard_map region (every listed axis manual): B's half returns, besides its outputs,
  each device's saved values, stacked on a new leading axis split over the manual axes; W's
  half takes them back the same way, so every device reads its own."""

  @staticmethod
  def b_mask(eqn, used):
    return list(used)

  @staticmethod
  def carries(eqn):
    return ()

  @staticmethod
  def b_reads(eqn, body):
    return set()

  @staticmethod
  def readable(eqn, body):
    return set(body.invars)

  @staticmethod
  def _call(eqn, local, in_specs, out_specs, args):
    p = eqn.params
    manual = p.get("manual_axes", p.get("newly_manual_axes"))
    return jax.shard_map(local, mesh=p["mesh"], in_specs=tuple(in_specs),
                         out_specs=tuple(out_specs), axis_names=set(manual),
                         check_vma=p["check_vma"])(*args)

  @staticmethod
  def _stacked(eqn, sub) -> list:
    """Per saved value, the spec of its stack: the manual axes it varies over (with
    check_vma; all of them without), so W's half sees it exactly as B's computed it."""
    p = eqn.params
    manual = p.get("manual_axes", p.get("newly_manual_axes"))
    axes = [a for a in p["mesh"].axis_names if a in manual]
    if not p["check_vma"]:
      return [P(tuple(axes))] * len(sub.saved)
    return [P(tuple(a for a in axes if a in _vma(sub, x))) for x in sub.saved]

  @classmethod
  def run_b(cls, eqn, sub, env):
    p = eqn.params
    reads = _reads(eqn, sub.b_invars)
    n_out = sum(sub.b_out)

    def local(*args):
      outs, saved = _run_b(sub, {**_body_env(eqn), **dict(zip([v for _, v in reads], args))})
      return tuple(outs) + tuple(x[None] for x in saved)
    out_specs = [s for s, b in zip(p["out_specs"], sub.b_out) if b]
    out_specs += cls._stacked(eqn, sub)
    res = cls._call(eqn, local, [p["in_specs"][k] for k, _ in reads], out_specs,
                    [_read(env, eqn.invars[k]) for k, _ in reads])
    return list(res[:n_out]), list(res[n_out:])

  @classmethod
  def run_w(cls, eqn, sub, env, kept):
    p = eqn.params
    reads = _reads(eqn, sub.w_invars)

    def local(*args):
      inner = {**_body_env(eqn), **dict(zip([v for _, v in reads], args)),
               **dict(zip(sub.saved, [x[0] for x in args[len(reads):]]))}
      return tuple(_run_w(sub, inner))
    in_specs = [p["in_specs"][k] for k, _ in reads] + cls._stacked(eqn, sub)
    out_specs = [s for s, w in zip(p["out_specs"], sub.w_out) if w]
    res = cls._call(eqn, local, in_specs, out_specs,
                    [_read(env, eqn.invars[k]) for k, _ in reads] + list(kept))
    return list(res)


_NESTED = {"scan": _Scan, "shard_map": _ShardMap}


def _vma(plan: _Plan, item) -> frozenset:
  """The manual axes a saved value of `plan` varies over (a nested one's: as its body's)."""
  if isinstance(item, tuple):
    sub, _ = plan.nested[item[0]]
    return _vma(sub, sub.saved[item[1]])
  mat = getattr(item.aval, "mat", None)     # jax 0.10: aval.mat.varying; else aval.vma
  return mat.varying if mat is not None else getattr(item.aval, "vma", frozenset())


def _inline(jaxpr):
  """(equations, outvars) of `jaxpr` with checkpoint regions inlined (their inner variables
  are distinct objects, so they are used as they are; an outer variable equal to an inner
  one is renamed to it)."""
  alias, eqns = {}, []

  def resolve(a):
    while _is_var(a) and a in alias:
      a = alias[a]
    return a

  def walk(inner_eqns):
    for eqn in inner_eqns:
      if eqn.primitive.name == _CHECKPOINT and not eqn.params["jaxpr"].constvars:
        inner = eqn.params["jaxpr"]
        for v, a in zip(inner.invars, eqn.invars):
          alias[v] = resolve(a)
        walk(inner.eqns)
        for o, a in zip(eqn.outvars, inner.outvars):
          if _is_var(o):
            alias[o] = resolve(a)
      else:
        eqns.append(eqn.replace(invars=[resolve(a) for a in eqn.invars]))
  walk(jaxpr.eqns)
  return eqns, [resolve(a) for a in jaxpr.outvars]


def _is_var(a) -> bool:
  return isinstance(a, core.Var) and not isinstance(a, core.DropVar)


def _read(env, a):
  return a.val if isinstance(a, core.Literal) else env[a]


def _write(env, outvars, values):
  for o, x in zip(outvars, values):
    if _is_var(o):
      env[o] = x


def _bind(eqn, invals) -> list:
  params = eqn.primitive.get_bind_params(eqn.params)
  subfuns = []
  if isinstance(params, tuple):    # older jax: (subfuns, params)
    subfuns, params = params
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*subfuns, *invals, **params)
  return out if eqn.primitive.multiple_results else [out]
