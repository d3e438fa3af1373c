"""`python -m cluster.doctor`: each check's verdict from readings (any machine), and the command on
this one."""

import json
import subprocess
import sys

from cluster.doctor import GIB, Readings, checks, gather, main

MAC = Readings(
    platform="darwin",
    versions={"python": "3.12.8", "ray": "2.60.0", "mlx": "0.32.4", "mlx-lm": "0.32.2", "orchard": "0.1.0"},
    ram_total=64 * GIB,
    ram_available=30 * GIB,
    recommended_working_set=48 * GIB,
    pressure="normal",
    store_root="/Users/a/.cache/orchard/models",
    store_free=500 * GIB,
    token_file="/tmp/orchard-1234abcd/auth_token",
    token_mode=0o100600,
    token_owned=True,
)


def verdicts(r: Readings, **kw) -> dict[str, str]:
    return {c.name: c.level for c in checks(r, **kw)}


def test_a_healthy_mac_passes_every_check_and_says_its_wired_ceiling():
    found = checks(MAC, expect=dict(MAC.versions))
    assert {c.level for c in found} == {"ok"}
    (wired,) = [c for c in found if c.name == "wired limit"]
    assert "48.0 GiB of 64 GiB from the recommended working set" in wired.words
    raised = {c.name: c for c in checks(MAC.model_copy(update={"wired_limit": 60 * GIB}))}["wired limit"]
    assert raised.level == "warn" and "60.0 GiB of 64 GiB from iogpu.wired_limit_mb" in raised.words


def test_each_problem_fails_its_own_check_and_names_it():
    other = dict(MAC.versions, ray="2.59.0")
    (versions,) = [c for c in checks(MAC, expect=other) if c.name == "versions"]
    assert versions.level == "FAIL" and "ray 2.60.0 here, 2.59.0 there" in versions.words
    assert verdicts(MAC.model_copy(update={"pressure": "critical"}))["memory pressure"] == "FAIL"
    assert verdicts(MAC.model_copy(update={"store_free": 5 * GIB}))["store disk"] == "warn"
    assert verdicts(MAC.model_copy(update={"store_free": None}))["store disk"] == "FAIL"
    assert verdicts(MAC.model_copy(update={"token_mode": 0o100644}))["token file"] == "FAIL"
    assert verdicts(MAC.model_copy(update={"token_owned": False}))["token file"] == "FAIL"
    assert verdicts(MAC.model_copy(update={"versions": {"python": "3.12.8"}}))["mlx"] == "FAIL"
    linux = MAC.model_copy(update={"platform": "linux", "pressure": "some avg10=12.50 avg60=3.00 avg300=1.00 total=99"})
    assert verdicts(linux)["memory pressure"] == "FAIL" and "wired limit" not in verdicts(linux)


def test_the_command_reads_this_machine_and_exits_non_zero_only_on_a_failure(tmp_path, capsys):
    here = gather(tmp_path)  # a temp dir without a token file
    assert here.token_mode is None and here.versions["python"] and here.store_free is not None
    (tmp_path / "there.json").write_text(json.dumps({"versions": dict(here.versions, ray="0.0.1")}))
    assert main(["--dir", str(tmp_path), "--expect", str(tmp_path / "there.json")]) == 1
    assert "FAIL versions" in capsys.readouterr().out
    done = subprocess.run([sys.executable, "-m", "cluster.doctor", "--dir", str(tmp_path), "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and json.loads(done.stdout)["versions"] == here.versions
