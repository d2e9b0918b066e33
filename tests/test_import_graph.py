"""The module graph: every module of the library imports on its own, the import graph (module-level and in-function
imports alike) has no cycle, the kernels depend on nothing of the application, and the engine names no strategy."""

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("recguide_jax", "pallas_kernels")


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for pkg in PACKAGES:
    for path in sorted((ROOT / pkg).rglob("*.py")):
      parts = list(path.relative_to(ROOT).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out[".".join(parts)] = path
  return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
  """The library modules `name` imports: `import a.b` and `from a import b` (b a submodule or a name of a), plus
  the packages above each one that lie outside `name`'s own package (their __init__ runs first)."""
  is_pkg = path.name == "__init__.py"
  here = name if is_pkg else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    targets = []
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = here.split(".")[:len(here.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    for t in targets:
      while t and t not in MODULES:  # `import a.b.c` of a name inside a module
        t = t.rpartition(".")[0]
      if not t:
        continue
      found.add(t)
      parent = t.rpartition(".")[0]
      while parent and not here.startswith(parent):
        found.add(parent)
        parent = parent.rpartition(".")[0]
  found.discard(name)
  return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in graph:
    if v not in index:
      visit(v)
  return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_import_graph_has_no_cycle():
  assert _cycles(GRAPH) == []


def test_the_cycle_check_sees_cycles():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_kernels_import_nothing_of_the_application():
  for name, deps in GRAPH.items():
    if name.startswith("pallas_kernels"):
      assert not any(d.startswith("recguide_jax") for d in deps), (name, deps)


def test_engine_and_runtime_depend_on_no_strategy():
  """The engine and the device side import no strategy (the engine knows the protocol and its grouping rule only),
  and no engine code names RecGuide or its rounds."""
  protocol = ("recguide_jax.decoding", "recguide_jax.decoding.strategy", "recguide_jax.decoding.grouping")
  for name, path in MODULES.items():
    if name.startswith(("recguide_jax.engine", "recguide_jax.runtime")):
      assert not any(d.startswith(("recguide_jax.recguide", "recguide_jax.decoding")) for d in GRAPH[name]
                     if not (name.startswith("recguide_jax.engine") and d in protocol)), name
    if name.startswith("recguide_jax.engine"):
      text = path.read_text().lower().replace("recguide_jax", "").replace("recguide-engine", "")
      assert "recguide" not in text and "overlap" not in text, name


def test_server_and_protocol_depend_on_no_strategy():
  """The HTTP server reads a strategy only through the protocol (`metrics()`, `name`), and the protocol itself
  (`decoding.strategy`, `decoding.grouping`) imports no strategy: neither imports RecGuide or the fixed strategies,
  and no server module names a strategy's internals (its regimes, overlap rounds or class)."""
  strategies = ("recguide_jax.recguide", "recguide_jax.decoding.builtin", "recguide_jax.decoding.rounds",
                "recguide_jax.decoding.registry")
  protocol = ("recguide_jax.decoding.strategy", "recguide_jax.decoding.grouping")
  for name, path in MODULES.items():
    if name.startswith("recguide_jax.server") or name in protocol:
      assert not any(d.startswith(strategies) for d in GRAPH[name]), (name, sorted(GRAPH[name]))
    if name.startswith("recguide_jax.server"):
      text = path.read_text()
      for word in ("RecGuideStrategy", "overlap", "regime", "_regime_memo", "LinearStrategy"):
        assert word not in text, (name, word)


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not n.endswith("__main__")))
def test_each_module_imports(name):
  importlib.import_module(name)
