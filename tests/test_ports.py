"""cluster/ports.py: the free ports a local cluster's nodes are given."""


def test_free_ports_are_distinct_and_avoid_the_ones_taken():
    """A node's Ray components get ports that differ from each other and from the cluster's others
    (two free_port calls once gave the dashboard agent and the metrics exporter one port)."""
    from cluster.ports import free_ports

    first = free_ports("127.0.0.1", 50)
    assert len(set(first)) == 50
    again = free_ports("127.0.0.1", 50, avoid=set(first))
    assert len(set(again)) == 50 and not set(again) & set(first)
