"""The suite's own rule (tests/conftest.py): a module that starts or uses a Ray cluster is marked
`cluster`, so that `make test`'s two pytest processes never run two clusters at once (one runs every
such module in turn; the other runs the tests that need no cluster)."""

import ast
import re
from pathlib import Path

TESTS = Path(__file__).parent
# What starts a cluster or reaches one: Ray's own starters, Orchard's launcher, the shared cluster's fixture,
# the Serve app's builder in tests/support/cluster.py.
STARTS_RAY = re.compile(r"\bray\.init\(|cluster_utils|\bcluster\.local\b|from cluster import [^\n]*\blocal\b|\bshared_ray\b|\bserve_orchard\(")


def marked(text: str) -> bool:
    """A module-level `pytestmark` (not a line that only looks like one, inside a string) naming `pytest.mark.cluster`."""
    return any(
        isinstance(node, ast.Assign)
        and any(isinstance(target, ast.Name) and target.id == "pytestmark" for target in node.targets)
        and "pytest.mark.cluster" in ast.unparse(node.value)
        for node in ast.parse(text).body
    )


def test_every_module_that_starts_or_uses_a_ray_cluster_is_marked_cluster():
    unmarked = [
        p.name
        for p in sorted(TESTS.glob("test_*.py"))
        if p.name != Path(__file__).name and STARTS_RAY.search(text := p.read_text()) and not marked(text)
    ]
    assert unmarked == [], f"mark these `pytestmark = pytest.mark.cluster` (conftest.py says why): {unmarked}"


def test_the_rule_sees_the_modules_it_is_about():
    seen = {p.name for p in TESTS.glob("test_*.py") if marked(p.read_text())}
    assert {"test_cluster_e2e.py", "test_node_loss.py", "test_security_ray.py", "test_cluster_nodes.py"} <= seen
