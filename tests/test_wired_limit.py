"""M3: a Mac's GPU wired-memory ceiling (`iogpu.wired_limit_mb`) is what its node offers: the agent
parses sysctl's answer (cluster/wired.py) and the node's usable memory never passes it."""

from cluster.node_report import GIB, Readings, measure
from cluster.wired import parse_wired_limit_mb, wired_limit_bytes

MAC = {"device_name": "Apple M4 Max", "memory_size": 128 * GIB, "max_recommended_working_set_size": 96 * GIB}


def test_m3_sysctls_answer_is_parsed_and_zero_means_the_default():
    assert parse_wired_limit_mb("57344\n") == 56 * GIB
    assert parse_wired_limit_mb("iogpu.wired_limit_mb: 120000") == 120000 * 2**20
    assert parse_wired_limit_mb("0\n") is None  # not set: the recommended working set applies
    assert parse_wired_limit_mb("") is None
    assert parse_wired_limit_mb("sysctl: unknown oid 'iogpu.wired_limit_mb'") is None
    assert wired_limit_bytes("linux") is None  # only a Mac has one


def test_m3_a_macs_usable_memory_is_its_wired_limit_where_one_is_set_else_the_recommended_working_set():
    def usable(wired):
        readings = Readings(platform="darwin", device_info=MAC, ram_total=128 * GIB, ram_available=100 * GIB, wired_limit=wired)
        return measure(None, readings).usable_bytes

    assert usable(None) == 96 * GIB
    assert usable(56 * GIB) == 56 * GIB  # lowered: the policy plans within it
    assert usable(120 * GIB) == 120 * GIB  # raised by the operator for a larger model
    assert usable(200 * GIB) == 128 * GIB  # never past the machine
    budget = measure(64 * GIB, Readings(platform="darwin", device_info=MAC, ram_total=128 * GIB, ram_available=100 * GIB, wired_limit=120 * GIB))
    assert budget.usable_bytes == 64 * GIB  # a declared budget still caps it
