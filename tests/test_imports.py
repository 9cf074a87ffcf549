"""jax_flash's modules import each other in layers, never in a circle: each module can be read
(and imported first) without the ones above it. The import graph is read from the source with
ast, imports inside functions included (a deferred import hides a circle, it does not remove it).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "jax_flash"
PACKAGE_DIR = REPO / PACKAGE


def module_names(package_dir: pathlib.Path = PACKAGE_DIR) -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every .py file of the package (packages by __init__)."""
  names = {}
  for path in sorted(package_dir.rglob("*.py")):
    parts = (PACKAGE, *path.relative_to(package_dir).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    names[".".join(parts)] = path
  return names


def bound_names(source: str) -> set[str]:
  """The names a module's top level binds (imports, definitions, assignments)."""
  names = set()
  for node in ast.parse(source).body:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      names.update((a.asname or a.name).split(".")[0] for a in node.names)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
  return names


def imported_modules(source: str, name: str, is_package: bool,
                     bound: dict[str, set[str]]) -> set[str]:
  """The package's modules (the keys of `bound`: module -> the names it binds) that module
  `name`'s source imports, anywhere in it. `from P import x` imports module P.x where that is
  one of them, P itself where P binds x, and nothing of ours otherwise (a native extension)."""
  package = name if is_package else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: from the package, up level - 1 packages
        anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
      for alias in node.names:
        submodule = f"{base}.{alias.name}"
        if submodule in bound:
          found.add(submodule)
        elif alias.name in bound.get(base, ()) or alias.name == "*":
          found.add(base)
  return {m for m in found if m in bound and m != name}


def import_graph(package_dir: pathlib.Path = PACKAGE_DIR) -> dict[str, set[str]]:
  """Module -> the package's modules it imports."""
  files = module_names(package_dir)
  sources = {name: path.read_text() for name, path in files.items()}
  bound = {name: bound_names(source) for name, source in sources.items()}
  return {name: imported_modules(source, name, files[name].name == "__init__.py", bound)
          for name, source in sources.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import circle of `graph` (its modules in order, the first repeated at the end), or
  None."""
  done: set[str] = set()
  path: list[str] = []

  def visit(node: str) -> list[str] | None:
    if node in path:
      return path[path.index(node):] + [node]
    if node in done:
      return None
    path.append(node)
    for child in sorted(graph.get(node, ())):
      cycle = visit(child)
      if cycle:
        return cycle
    path.pop()
    done.add(node)
    return None

  for node in sorted(graph):
    cycle = visit(node)
    if cycle:
      return cycle
  return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
  seen, todo = set(), [start]
  while todo:
    for child in graph.get(todo.pop(), ()):
      if child not in seen:
        seen.add(child)
        todo.append(child)
  return seen


def test_no_import_circle():
  """Fails on jax_flash 0.1.0: _attention -> _sharding -> _ring -> _attention."""
  graph = import_graph()
  assert "jax_flash._attention" in graph and graph["jax_flash._attention"], graph
  cycle = find_cycle(graph)
  assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_layers():
  """ring_attention and context_parallel_attention (jax_flash._context_parallel, over the ring
  algorithm of jax_flash._ring) sit below the public dot_product_attention (they share the
  dispatch and op layers), and the op layer knows nothing of partitioning or the public API."""
  graph = import_graph()
  for entry in ("jax_flash._ring", "jax_flash._context_parallel"):
    assert "jax_flash._attention" not in reachable(graph, entry), entry
  assert {"jax_flash._dispatch", "jax_flash._ops", "jax_flash._ring"} <= graph[
      "jax_flash._context_parallel"]
  assert "jax_flash._ops" in graph["jax_flash._ring"]
  below_ops = reachable(graph, "jax_flash._ops")
  assert not below_ops & {"jax_flash._attention", "jax_flash._sharding", "jax_flash._ring",
                          "jax_flash.flax"}, below_ops


def test_the_checker_sees_deferred_and_relative_imports():
  """The circle of jax_flash 0.1.0 (_attention -> _sharding -> _ring -> _attention, the last
  import inside a function) is found; so are relative imports."""
  sources = {
      "jax_flash._attention": "from jax_flash import _ops, _sharding\n",
      "jax_flash._sharding": "from . import _ring\n",
      "jax_flash._ring": "def ring_attention():\n  from jax_flash import _attention\n",
      "jax_flash": "from jax_flash._attention import dot_product_attention\n",
  }
  bound = {name: bound_names(src) for name, src in sources.items()}
  graph = {name: imported_modules(src, name, name == "jax_flash", bound)
           for name, src in sources.items()}
  assert graph["jax_flash._sharding"] == {"jax_flash._ring"}
  assert graph["jax_flash._ring"] == {"jax_flash._attention"}
  cycle = find_cycle(graph)
  assert cycle is not None and cycle[0] == cycle[-1] and len(cycle) == 4, cycle
  del graph["jax_flash._ring"]
  assert find_cycle(graph) is None


def test_flax_module_without_flax_says_what_to_install():
  """`import jax_flash.flax` where Flax is not installed names the extra that brings it (as
  pyproject.toml defines it), instead of a bare ModuleNotFoundError."""
  pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
  extras = pyproject["project"]["optional-dependencies"]
  extra = next(name for name, deps in extras.items() if any(d.startswith("flax") for d in deps))
  script = ("import sys\n"
            "sys.modules['flax'] = None  # as if Flax were not installed\n"
            "try:\n"
            "  import jax_flash.flax\n"
            "except ImportError as e:\n"
            "  print(type(e).__name__, e)\n"
            "import jax_flash  # the core package does not need Flax\n")
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, check=True)
  assert result.stdout.startswith("ImportError jax_flash.flax needs Flax"), result.stdout
  assert f'pip install "jax_flash[{extra}]"' in result.stdout, result.stdout
