"""D2: policy/ is pure: no Ray, MLX, FastAPI, clock, randomness or I/O modules."""

import ast
from pathlib import Path

POLICY = Path(__file__).resolve().parent.parent / "policy"
FORBIDDEN = {"ray", "mlx", "mlx_lm", "fastapi", "starlette", "time", "datetime", "random", "os", "socket", "asyncio", "threading"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_policy_imports_nothing_impure():
    files = sorted(POLICY.glob("*.py"))
    assert len(files) > 5
    for f in files:
        bad = imported_roots(f) & FORBIDDEN
        assert not bad, f"{f.name} imports {sorted(bad)}"


def test_policy_never_calls_open_or_print():
    for f in POLICY.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in {"open", "print", "input", "exec", "eval"}, f"{f.name} calls {node.func.id}"
