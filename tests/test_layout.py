"""The layout's two limits for `router/`, `deployments/` and `cluster/` (README, Layout): no module over
600 lines, and no import circle among their modules. Read from the source: every import counts,
absolute or relative, at module level or inside a function (a deferred import is still a dependency),
and under `if TYPE_CHECKING:` too (a part that needs another's type depends on a small Protocol of
what it uses instead: router/residency/parts.py, router/serving/standing.py's LeaseSource)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("router", "deployments", "cluster")
MAX_LINES = 600


def modules() -> dict[str, Path]:
    """Every module of the three packages by its dotted name (a package by its __init__.py)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that `name` (at `path`) imports. `from m import x` is m.x where x is a
    module, else m; `import a.b.c` is the longest known prefix of a.b.c."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                dotted = alias.name
                while dotted and dotted not in known:
                    dotted = dotted.rpartition(".")[0]
                if dotted:
                    found.add(dotted)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for alias in node.names:
                if f"{module}.{alias.name}" in known:
                    found.add(f"{module}.{alias.name}")
                elif module in known:
                    found.add(module)
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a path that comes back to its start) per strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's; the packages are ~250 modules, far below the recursion limit
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_path_back(min(group), group, edges) for group in groups]


def _path_back(start: str, group: set[str], edges: dict[str, set[str]]) -> list[str]:
    """The shortest path from `start` back to itself inside `group` (breadth first)."""
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(edges[v] & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in came:
                    came[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"{start} is in a circle it cannot reach back to")


def test_no_module_is_over_600_lines():
    found = modules()
    assert len(found) > 150
    long = {str(p.relative_to(ROOT)): n for p in found.values() if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"split these by concern (issue 43: at most {MAX_LINES} lines): {long}"


def test_no_import_circle_among_the_modules():
    found = circles(graph())
    assert found == [], "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_reader_sees_the_imports_it_is_about():
    edges = graph()
    # absolute, at module level
    assert "router.residency.placements" in edges["router.residency.controller"]
    # inside a function (model_server_options imports Ray's scheduling strategy there; Orchard's own: this one)
    assert "deployments.models" in edges["deployments.model_server"]
    # `from package import module`
    assert "cluster.ports" in edges["router.console.demo_cluster"]
    # what the residency parts use of the loop is a protocol, not the controller
    assert "router.residency.parts" in edges["router.residency.placements"]
    assert "router.residency.controller" not in edges["router.residency.placements"]


def test_circles_are_found_with_a_path_back():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert circles(edges) == [["a", "b", "c", "a"]]
    edges = {"x": {"y"}, "y": {"x"}, "p": {"q"}, "q": set()}
    assert circles(edges) == [["x", "y", "x"]]
