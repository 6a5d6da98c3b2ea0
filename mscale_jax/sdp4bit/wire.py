"""Bytes on the wire: what every collective of a compiled XLA program moves per execution.

Reads the optimized HLO text (`jax.jit(f).lower(...).compile().as_text()`), finds each
all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute (the `-start` half
of async pairs), sizes its operands from their definitions, and counts it as many times as it
runs: collectives inside a `while` body (scan over layers) count `known_trip_count` times.

Two figures per collective, per device: `operand_bytes`, the size of what the device hands to
the collective, and `sent_bytes`, what a ring (or direct all-to-all) sends for it among a group
of n devices: all-gather (n - 1) x operand, reduce-scatter and all-to-all (n - 1) / n x operand,
all-reduce 2 (n - 1) / n x operand, collective-permute 1 x operand.
"""
import collections
import dataclasses
import re

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "s4": 0.5, "u4": 0.5,
               "f8e4m3fn": 1, "f8e5m2": 1}

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([\w\-]+)\((.*?)\)(.*)$")
_ARRAY = re.compile(r"([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_CALLS = re.compile(r"(?:body|condition|to_apply|calls|true_computation|false_computation)="
                    r"%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'known_trip_count[^0-9]*([0-9]+)')


@dataclasses.dataclass
class Collective:
  """One collective op of a compiled program: its kind, bytes, group size and executions."""
  kind: str
  operand_bytes: float       # per device, per execution
  group: int                 # devices taking part together
  count: int                 # executions per program run

  @property
  def sent_bytes(self) -> float:
    """Bytes one device sends for one execution (ring / direct algorithm)."""
    n, b = self.group, self.operand_bytes
    if n <= 1:
      return 0.0
    return {"all-gather": (n - 1) * b, "reduce-scatter": (n - 1) / n * b,
            "all-to-all": (n - 1) / n * b, "all-reduce": 2 * (n - 1) / n * b,
            "collective-permute": b}[self.kind]


def type_bytes(hlo_type: str) -> float:
  """Bytes of an HLO type: 'f32[4,8]{1,0}' or a tuple '(u8[2,64]{...}, f32[2]{0})'."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(hlo_type):
    size = 1
    for d in filter(None, dims.split(",")):
      size *= int(d)
    total += DTYPE_BYTES.get(dtype, 0) * size
  return total


def _group_size(attrs: str) -> int:
  """Devices per replica group, from any of XLA's three spellings."""
  m = re.search(r"replica_groups=\{\{([0-9,]*)\}", attrs)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[([0-9]+),([0-9]+)\]<=", attrs)
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\].*?\{([^}]*)\}", attrs)
  if m:
    sizes = dict((k.strip("'"), int(v)) for k, v in
                 (item.split("=") for item in m.group(1).split(",")))
    size = 1
    for axis in re.findall(r"'([^']+)'", m.group(2)):
      size *= sizes[axis]
    return size
  m = re.search(r"source_target_pairs=\{([^}]*)\}", attrs)
  return 2 if m else 1


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective of an optimized HLO module, with how often one program run executes it."""
  comps, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      current = header.group(2)
      comps[current] = []
      entry = current if header.group(1) else entry
    elif current is not None and line.strip() == "}":
      current = None
    elif current is not None:
      comps[current].append(line)

  shapes, found, calls = {}, collections.defaultdict(list), collections.defaultdict(list)
  for name, lines in comps.items():
    for line in lines:
      m = _DEF.match(line)
      if not m:
        continue
      var, hlo_type, op, operands, attrs = m.groups()
      shapes[var] = hlo_type
      trip = _TRIP.search(attrs)
      for callee in _CALLS.findall(attrs):
        calls[name].append((callee, int(trip.group(1)) if op == "while" and trip else 1))
      for branch in _BRANCHES.findall(attrs):
        calls[name] += [(b.strip().lstrip("%"), 1) for b in branch.split(",") if b.strip()]
      kind = op[:-len("-start")] if op.endswith("-start") else op
      if kind in KINDS:
        names = [o.strip().split(" ")[-1].lstrip("%") for o in operands.split(",") if o.strip()]
        found[name].append((kind, names, _group_size(attrs)))

  runs = collections.Counter()

  def visit(comp, times):
    runs[comp] += times
    for callee, factor in calls.get(comp, ()):
      if callee in comps:
        visit(callee, times * factor)
  visit(entry, 1)
  out = []
  for comp, items in found.items():
    for kind, names, group in items:
      size = sum(type_bytes(shapes.get(n, "")) for n in names)
      out.append(Collective(kind, size, group, runs[comp]))
  return out


def bytes_by_kind(hlo_text: str) -> dict[str, dict[str, float]]:
  """{kind: {'ops', 'executions', 'operand_bytes', 'sent_bytes'}} per device per program run."""
  out = {}
  for c in collectives(hlo_text):
    row = out.setdefault(c.kind, {"ops": 0, "executions": 0, "operand_bytes": 0.0,
                                  "sent_bytes": 0.0})
    row["ops"] += 1
    row["executions"] += c.count
    row["operand_bytes"] += c.count * c.operand_bytes
    row["sent_bytes"] += c.count * c.sent_bytes
  return out
