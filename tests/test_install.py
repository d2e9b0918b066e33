"""`pip install -e .` alone must give every third-party module the shipped code imports (recguide_jax/,
pallas_kernels/, launch/): each must come from a core dependency in pyproject.toml or from one of theirs,
transitively; extras do not count (a fresh install does not get them). The test extra's torch brought jinja2 along,
which once hid that the tokenizer's chat templates needed it. `.ci/run` checks the same thing for real in a fresh
venv; this is the fast static check inside the suite."""

from __future__ import annotations

import ast
import importlib.metadata as md
import pathlib
import re
import sys
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[1]
SHIPPED = ("recguide_jax", "pallas_kernels", "launch")
# Launch scripts that say in their docstring that they need an extra: their imports must come with that extra.
# (bench_peer and check_smollm2 run transformers' own model as the reference: torch + transformers, the test extra.)
NEEDS_EXTRA = {"launch/bench_peer.py": "test", "launch/check_smollm2.py": "test"}


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
  return _norm(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0])


def _closure(roots) -> set[str]:
  """Distributions a plain install of `roots` brings, following their non-extra requirements."""
  seen, todo = set(), [_norm(r) for r in roots]
  while todo:
    dist = todo.pop()
    if dist in seen:
      continue
    seen.add(dist)
    try:
      reqs = md.requires(dist) or []
    except md.PackageNotFoundError:
      continue
    todo += [_requirement_name(r) for r in reqs if "extra ==" not in r]
  return seen


def _third_party_imports(skip=()) -> dict[str, str]:
  """top-level module -> where it is first imported, over the shipped code (less the files in `skip`)."""
  local = {p.name for p in REPO.iterdir() if (p / "__init__.py").exists()} | {p.stem for p in REPO.glob("launch/*.py")}
  out = {}
  for folder in SHIPPED:
    for path in sorted((REPO / folder).rglob("*.py")):
      if str(path.relative_to(REPO)) in skip:
        continue
      for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
          names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
          names = [node.module]
        else:
          continue
        for name in names:
          top = name.split(".")[0]
          if top not in sys.stdlib_module_names and top not in local and top != "__future__":
            out.setdefault(top, f"{path.relative_to(REPO)}:{node.lineno}")
  return out


def _undeclared(imports: dict[str, str], installed: set[str]) -> list[str]:
  mod2dist = md.packages_distributions()
  missing = []
  for top, where in sorted(imports.items()):
    dists = mod2dist.get(top)
    if not dists:
      continue  # not installed here: an optional import (e.g. triton on a GPU build), guarded where it is used
    if not any(_norm(d) in installed for d in dists):
      missing.append(f"{top} ({dists[0]}) imported at {where}")
  return missing


def test_every_import_of_the_shipped_code_is_a_declared_dependency():
  project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
  core = [_requirement_name(d) for d in project["dependencies"]]
  missing = _undeclared(_third_party_imports(skip=NEEDS_EXTRA), _closure(core))
  assert not missing, "add to [project].dependencies in pyproject.toml: " + "; ".join(missing)
  for path, extra in NEEDS_EXTRA.items():
    assert f"{extra} extra" in (REPO / path).read_text(), f"{path} does not say it needs the {extra} extra"
    with_extra = _closure(core + [_requirement_name(d) for d in project["optional-dependencies"][extra]])
    others = {p for p in NEEDS_EXTRA if p != path} | {str(p.relative_to(REPO)) for f in SHIPPED
                                                       for p in (REPO / f).rglob("*.py")} - {path}
    missing = _undeclared(_third_party_imports(skip=others), with_extra)
    assert not missing, f"add to the {extra} extra in pyproject.toml: " + "; ".join(missing)


def test_accelerator_extras_pin_jax_builds():
  extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  assert [_requirement_name(r) for r in extras["cuda"]] == ["jax"] and "[cuda12]" in extras["cuda"][0]
  assert [_requirement_name(r) for r in extras["tpu"]] == ["jax"] and "[tpu]" in extras["tpu"][0]
