"""The README's picture of who imports whom (Layout, the `imports` block) is the code's: every arrow
drawn is an import some file makes, every import between two parts is drawn, and every part is in
the Layout tree. Read from the source (absolute and relative imports, at any depth of a file, so a
function's own import counts), the way tests/test_import_direction.py reads its rules."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PACKAGES = ("policy", "deployments", "cluster", "router", "bench")


def picture() -> dict[str, set[str]]:
    """{part: the parts it imports}, from the README's fenced block that opens with `imports`."""
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"^```imports\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) == 1, "README.md has one ```imports block (its Layout section)"
    drawn: dict[str, set[str]] = {}
    for line in blocks[0].splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        part, arrow, targets = line.partition("->")
        assert arrow, f"not `part -> parts`: {line!r}"
        names = targets.replace(",", " ").split()
        drawn[part.strip()] = set() if names == ["(nothing)"] else set(names)
    return drawn


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str, parts: list[str]) -> str | None:
    """The most specific part a dotted module lies in (`router/metrics.py` is the module router.metrics)."""
    best = None
    for part in parts:
        dotted = part.removesuffix(".py").replace("/", ".")
        if (module == dotted or module.startswith(dotted + ".")) and (best is None or len(dotted) > len(best.removesuffix(".py"))):
            best = part
    return best


def imported(path: Path) -> set[str]:
    """Every dotted name `path` imports: a module, and for `from m import x` also `m.x` (x may be a module)."""
    package = module_of(path) if path.name == "__init__.py" else module_of(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] in PACKAGES}


def real_graph(parts: list[str]) -> tuple[dict[str, dict[str, set[str]]], list[str]]:
    """{part: {imported part: the files that import it}}, and the files that lie in no part."""
    graph: dict[str, dict[str, set[str]]] = {p: {} for p in parts}
    outside = []
    for package in PACKAGES:
        for f in sorted((ROOT / package).rglob("*.py")):
            source = part_of(module_of(f), parts)
            names = imported(f)
            if source is None:
                if names:
                    outside.append(str(f.relative_to(ROOT)))
                continue
            for name in names:  # `from router import metrics` names router and router.metrics
                target = part_of(name, parts)
                if target is not None and target != source:
                    graph[source].setdefault(target, set()).add(str(f.relative_to(ROOT)))
    return graph, outside


def test_every_arrow_of_the_readme_picture_is_an_import_and_every_import_is_drawn():
    drawn = picture()
    parts = sorted(drawn)
    graph, outside = real_graph(parts)
    assert not outside, f"files with imports in no part of the README's picture: {outside}"
    undrawn = {f"{a} -> {b} ({', '.join(sorted(files)[:3])})" for a, targets in graph.items() for b, files in targets.items() if b not in drawn[a]}
    unreal = {f"{a} -> {b}" for a, targets in drawn.items() for b in targets if b not in graph[a]}
    unknown = {b for targets in drawn.values() for b in targets} - set(parts)
    assert not unknown, f"the picture draws arrows to parts it does not list: {sorted(unknown)}"
    assert not undrawn, f"imports the README's picture does not draw: {sorted(undrawn)}"
    assert not unreal, f"arrows the README's picture draws that no import makes: {sorted(unreal)}"


def test_every_part_of_the_picture_is_in_the_layout_tree():
    text = README.read_text(encoding="utf-8")
    tree = re.search(r"^## Layout\n\n```\n(.*?)^```", text, re.S | re.M)
    assert tree, "README.md's Layout section opens with the tree"
    # the tree's entries by indentation: a top folder at column 0, its subfolders and files indented under it
    path: list[tuple[int, str]] = []
    listed = set()
    for line in tree.group(1).splitlines():
        m = re.match(r"( *)(\S+/|\S+\.py)\s", line + " ")
        if not m or (path and len(m.group(1)) > path[-1][0] + 4):
            continue  # a description's continuation line
        depth = len(m.group(1))
        path = [(d, n) for d, n in path if d < depth] + [(depth, m.group(2).rstrip("/"))]
        listed.add("/".join(n for _, n in path))
    missing = sorted(p for p in picture() if p not in listed)
    assert not missing, f"parts of the imports picture missing from the Layout tree: {missing}"
    for part in picture():
        assert (ROOT / part).exists(), f"the picture's part {part} is not in the tree of files"
