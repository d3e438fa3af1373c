"""The ingress replicas' direct addresses, read from a ServeInstanceDetails record (its target groups
and replicas, as Serve's controller returns them): by Orchard node name, alive nodes only."""

from cluster.serve_endpoints import direct_urls


def details(host: str = "127.0.0.1") -> dict:
    replica = {"actor_name": "SERVE_REPLICA::orchard#Ingress#{}", "node_id": "{}"}
    replicas = [{k: v.format(n) for k, v in replica.items()} for n in ("a", "b", "dead")]
    targets = [{"ip": "10.0.0.1", "port": 30000, "instance_id": "", "name": "SERVE_REPLICA::orchard#Ingress#a"}]
    targets += [{"ip": "10.0.0.2", "port": 30001, "instance_id": "", "name": "SERVE_REPLICA::orchard#Ingress#b"}]
    targets += [{"ip": "10.0.0.3", "port": 30000, "instance_id": "", "name": "SERVE_REPLICA::orchard#Ingress#dead"}]
    return {
        "http_options": {"host": host},
        "applications": {"orchard": {"deployments": {"Ingress": {"replicas": replicas}, "ResidencyService": {"replicas": []}}}},
        "target_groups": [
            {"protocol": "HTTP", "app_name": "orchard", "route_prefix": "/", "targets": targets},
            {"protocol": "gRPC", "app_name": "orchard", "route_prefix": "/", "targets": targets},
            {
                "protocol": "HTTP",
                "app_name": "",
                "route_prefix": "/",
                "targets": [{"ip": "10.0.0.1", "port": 8000, "instance_id": "", "name": "SERVE_PROXY_ACTOR-x"}],
            },
        ],
    }


def test_direct_urls_name_each_alive_nodes_replica_by_its_orchard_name():
    names = {"a": "head", "b": "mac-1"}  # "dead" is not alive: its replica is gone or going
    assert direct_urls(details(), "orchard", "127.0.0.1", names) == [
        {"node_id": "head", "url": "http://127.0.0.1:30000"},
        {"node_id": "mac-1", "url": "http://127.0.0.1:30001"},
    ]


def test_a_replica_listening_on_every_address_is_named_by_its_nodes_ip():
    urls = direct_urls(details("0.0.0.0"), "orchard", "0.0.0.0", {"a": "head", "b": "mac-1"})
    assert [u["url"] for u in urls] == ["http://10.0.0.1:30000", "http://10.0.0.2:30001"]


def test_no_direct_targets_without_direct_ingress():
    proxy_only = details() | {"target_groups": details()["target_groups"][2:]}
    assert direct_urls(proxy_only, "orchard", "127.0.0.1", {"a": "head"}) == []
    assert direct_urls(details(), "another-app", "127.0.0.1", {"a": "head"}) == []
