"""The README's import rule (Layout): `deployments/` imports only `policy/` and itself, and
`router/residency` imports `policy/`, `cluster/` and `deployments/`, never the ingress side
(`router/serving`, `router/api`, `router/protocols`, `router/console`). Read from the source, so a
new import that crosses the line fails here rather than in a process that lacks the other side."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORCHARD = {"policy", "router", "cluster", "deployments", "bench", "tests"}


def orchard_imports(path: Path) -> set[str]:
    """The Orchard modules `path` imports (absolute imports, at any depth of the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found |= {n for n in names if n.split(".")[0] in ORCHARD}
    return found


def test_deployments_import_only_policy_and_themselves():
    files = sorted((ROOT / "deployments").rglob("*.py"))
    assert len(files) > 10
    for f in files:
        bad = sorted(m for m in orchard_imports(f) if m.split(".")[0] not in ("policy", "deployments"))
        assert not bad, f"{f.relative_to(ROOT)} imports {bad}"


def test_residency_never_imports_the_ingress_side():
    files = sorted((ROOT / "router" / "residency").glob("*.py"))
    assert len(files) > 5
    ingress = ("router.serving", "router.api", "router.protocols", "router.console")
    for f in files:
        bad = sorted(m for m in orchard_imports(f) if m.startswith(ingress))
        assert not bad, f"{f.relative_to(ROOT)} imports {bad}"
