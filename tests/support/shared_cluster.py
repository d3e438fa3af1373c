"""One Ray cluster shared by the end-to-end modules that can share it (a head node with a 6 GiB budget,
2 CPUs): those that kill nodes, restart controllers or need several nodes keep their own.

conftest.py runs the sharing modules first and one after the other, starts the cluster for the first
of them, and shuts it down after the last (or at the end of the session, on -x). Between two modules
it resets what Orchard leaves in a cluster on purpose: the detached model servers (a restarted
controller adopts them) and the operator state in the GCS (pins, loads, events), so no module sees
another's."""

import os
import shutil
import tempfile
import time

import ray
from ray.cluster_utils import Cluster
from ray.experimental import internal_kv as kv

from cluster.ray_api import NAMESPACE
from support.cluster import node_args

NODE = "head"  # Orchard's name for the shared cluster's one node
BUDGET_GIB = 6


class SharedCluster:
    def __init__(self) -> None:
        self.cluster: Cluster | None = None
        self.temp: str | None = None
        self._tmpdir_before: str | None = None
        self.started_in_s = 0.0

    def acquire(self) -> str:
        """The Ray node id of the head, starting the cluster (and connecting this driver) if needed."""
        if self.cluster is None:
            started = time.monotonic()
            self.temp = tempfile.mkdtemp(prefix="orch-shared-", dir="/tmp")  # short: Ray's socket paths live here
            self._tmpdir_before = os.environ.get("RAY_TMPDIR")
            os.environ["RAY_TMPDIR"] = self.temp  # else Ray writes /tmp/ray/ray_current_cluster
            # a store of its own (empty: models load from the registry's folder), so nothing is left in the home folder
            head = node_args(NODE, BUDGET_GIB, 2) | {"include_dashboard": False, "env_vars": {"ORCHARD_STORE": os.path.join(self.temp, "store")}}
            self.cluster = Cluster(initialize_head=True, head_node_args=head)
            self.cluster.wait_for_nodes()
            ray.init(address=self.cluster.address, log_to_driver=False)
            self.started_in_s = time.monotonic() - started
        return ray.get_runtime_context().get_node_id()

    def reset(self) -> None:
        """Kill every actor in Orchard's namespace and drop Orchard's keys from the GCS."""
        if self.cluster is None:
            return
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if actor["namespace"] == NAMESPACE:
                try:
                    ray.kill(ray.get_actor(actor["name"], namespace=NAMESPACE), no_restart=True)
                except ValueError:  # gone meanwhile
                    pass
        for key in kv._internal_kv_list("", namespace=NAMESPACE):
            kv._internal_kv_del(key, namespace=NAMESPACE)

    def shutdown(self) -> None:
        if self.cluster is None:
            return
        ray.shutdown()
        self.cluster.shutdown()
        self.cluster = None
        if self._tmpdir_before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = self._tmpdir_before
        if self.temp is not None:
            shutil.rmtree(self.temp, ignore_errors=True)


SHARED = SharedCluster()
