"""Layers only point down: the room table of docs/architecture.md, checked against every import.

Every `import` statement of every module of mscale_jax, pallas_kernels and experiments is read
(imports inside functions too: a lazy import hides a cycle, it does not remove it). The test
fails on an import that points up or to a sibling room, on an import cycle between modules, and
on a module no room claims. Then every library module is imported in one fresh process.
"""
import ast
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("pallas_kernels", "mscale_jax", "experiments")


def read_layers() -> list[list[list[str]]]:
  """Lines of the ```layers block, bottom first: [line][room][entry]."""
  with open(os.path.join(REPO, "docs", "architecture.md")) as f:
    block = re.search(r"```layers\n(.*?)```", f.read(), re.S).group(1)
  lines = [line.split("#")[0].strip() for line in block.splitlines()]
  return [[room.split() for room in line.split("|")] for line in reversed(lines) if line]


def modules() -> dict[str, str]:
  """{dotted module name: path} of every .py file of our packages (a package is its
  __init__)."""
  out = {}
  for package in PACKAGES:
    for directory, _, files in os.walk(os.path.join(REPO, package)):
      for name in files:
        if name.endswith(".py"):
          path = os.path.join(directory, name)
          dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
          out[dotted.removesuffix(".__init__")] = path
  return out


def imports_of(name: str, path: str, known) -> set[str]:
  """Our modules that `name` imports anywhere in its file."""
  is_package = path.endswith("__init__.py")
  found = set()
  for node in ast.walk(ast.parse(open(path).read(), path)):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = name.split(".")[:len(name.split(".")) - node.level + is_package]
        base = ".".join(parts + ([node.module] if node.module else []))
      # `from package import module` imports the module; `from module import name` the module.
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                 for a in node.names]
    else:
      continue
    for target in targets:
      while target and target not in known:
        target = target.rpartition(".")[0]
      if target and target != name:
        found.add(target)
  return found


def room_of(module: str, layers):
  """(line, room) index of the entry that claims `module`: its own name, or the longest
  `package.*` above it."""
  best, best_len = None, -1
  for i, line in enumerate(layers):
    for j, room in enumerate(line):
      for entry in room:
        if entry.endswith(".*"):
          package = entry[:-2]
          hit = module == package or module.startswith(package + ".")
        else:
          package, hit = entry, module == entry
        if hit and len(package) > best_len:
          best, best_len = (i, j), len(package)
  return best


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_every_import_points_down_and_nothing_is_circular():
  layers = read_layers()
  known = modules()
  graph = {name: imports_of(name, path, known) for name, path in known.items()}
  unclaimed = sorted(m for m in known if room_of(m, layers) is None)
  assert not unclaimed, f"modules no room of docs/architecture.md claims: {unclaimed}"
  wrong = []
  for name, targets in sorted(graph.items()):
    line, room = room_of(name, layers)
    for target in sorted(targets):
      target_line, target_room = room_of(target, layers)
      if target_line > line or (target_line == line and target_room != room):
        wrong.append(f"{name} imports {target}")
  cycles = _cycles(graph)
  assert not wrong and not cycles, ("imports pointing up or sideways:\n" + "\n".join(wrong) +
                                    f"\nimport cycles: {cycles}")


def test_the_checks_catch_what_they_claim_to():
  """Negative controls on a made-up tree: an upward import, a sibling import, a cycle."""
  layers = [[["low.*"]], [["mid.a.*"], ["mid.b.*"]], [["top"]]]
  assert room_of("mid.a.x", layers) == (1, 0) and room_of("top.x", layers) is None
  assert room_of("low", layers) == (0, 0)
  graph = {"low.x": {"mid.a.y"}, "mid.a.y": {"low.x"}, "top": set()}
  assert _cycles(graph) == [["low.x", "mid.a.y"]]


def test_every_library_module_imports_in_a_fresh_process():
  names = sorted(m for m in modules() if m.split(".")[0] != "experiments")
  code = "import importlib, sys\nfor name in sys.argv[1:]:\n  importlib.import_module(name)"
  result = subprocess.run([sys.executable, "-c", code, *names], cwd=REPO, capture_output=True,
                          text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
  assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("package", ["mscale_jax"])
def test_no_file_of_the_library_is_over_500_lines(package):
  long = {os.path.relpath(p, REPO): n for p in modules().values()
          if p.startswith(os.path.join(REPO, package))
          and (n := sum(1 for _ in open(p))) > 520}
  assert not long, f"files over ~500 lines: {long}"


def defines_flags_on_import(source: str) -> bool:
  """Whether a module-level statement (not a function, a class or the `__main__` block) calls
  an absl `DEFINE_*` (flags' or config_flags')."""
  for statement in ast.parse(source).body:
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or (
        isinstance(statement, ast.If) and "__main__" in ast.unparse(statement.test)):
      continue
    for node in ast.walk(statement):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr.startswith("DEFINE")):
        return True
  return False


def test_experiments_the_tests_import_define_flags_only_as_scripts():
  """absl flags are process-global: two experiment scripts that define one name (`out_dir`,
  `quick`) and are imported in one pytest worker would clash. So every experiment module a test
  imports (directly or through another experiment) defines its flags in `define_flags()`,
  called only under `__main__`."""
  assert defines_flags_on_import("from absl import flags\nX = flags.DEFINE_bool('x', 0, '')")
  assert not defines_flags_on_import("def define_flags():\n  flags.DEFINE_bool('x', 0, '')\n"
                                     "if __name__ == '__main__':\n  define_flags()")
  known = modules()
  tests = os.path.join(REPO, "tests")
  todo = set()
  for name in os.listdir(tests):
    if name.endswith(".py"):
      todo |= imports_of(f"tests.{name[:-3]}", os.path.join(tests, name), known)
  seen = set()
  while todo:
    module = todo.pop()
    if module.startswith("experiments.") and module not in seen:
      seen.add(module)
      todo |= imports_of(module, known[module], known)
  assert {"experiments.convergence", "experiments.pipeline_schedule"} <= seen
  offenders = sorted(m for m in seen if defines_flags_on_import(open(known[m]).read()))
  assert not offenders, f"define their flags when imported: {offenders}"
