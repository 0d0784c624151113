"""``loraplex serve --ray --ray-address`` joining a cluster that is already running, of two
nodes (``ray.cluster_utils.Cluster``: two raylets on this machine, as ``ray start --head``
and ``ray start --address`` make them). Each node has 2 CPUs and each replica asks for 2, so
the two replicas run on different nodes. Both hold the launch adapter and a hot-loaded one;
on SIGTERM the server removes its app and registry and leaves the cluster running.
Marked slow (~1-2 min): ``pytest -m slow tests/test_ray_join_cluster.py``."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import ray
from loraplex.client import Client
from loraplex.proto import loraplex_pb2 as pb

from tests.conftest import make_adapter
from tests.server.ray_serve.conftest import replica_ids
from tests.test_ray_autoscaling import generate
from tests.test_ray_serve_process import free_port, kill_leftovers, popen_serve_ray


@pytest.mark.slow
def test_serve_joins_a_two_node_cluster_and_leaves_it_running(tiny_llama: Path,
                                                              tmp_path: Path) -> None:
    from loraplex.server.ray.launch import NAMESPACE, registry_name
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        launch = make_adapter(tiny_llama, tmp_path / "a", seed=3)
        hot = make_adapter(tiny_llama, tmp_path / "hot", seed=4)
        port = free_port()
        log = tmp_path / "serve.log"
        # --adapter-root: Ray's gRPC proxy listens on every interface, so a runtime load by
        # path needs a root (issue 42)
        proc = popen_serve_ray(tiny_llama, launch, port, log, "--adapter-root", str(tmp_path),
                               "--ray-address", cluster.address,
                               "--num-replicas", "2", "--replica-cpus", "2",
                               "--max-model-len", "128")
        target = f"127.0.0.1:{port}"
        try:
            with Client(target) as client:
                client.wait_until_serving(240)
                # both replicas joined the registry; Serve lists the last one as running
                # a moment later
                deadline = time.monotonic() + 30
                while len(replica_ids(client)) < 2:
                    assert time.monotonic() < deadline, log.read_text()[-3000:]
                    time.sleep(0.5)
                client.load_adapter("hot", hot)
                tiers = {i.name: {r.replica: r.state for r in i.replicas}
                         for i in client.list_adapters()}
                unheld = {pb.AdapterInfo.FAILED, pb.AdapterInfo.STATE_UNSPECIFIED}
                for name in ("a", "hot"):  # held on both nodes' replicas
                    assert len(tiers[name]) == 2 and not unheld & set(tiers[name].values())
                    # Ray's proxy prefers the replica on its own node: one answers here
                    ids, _ = generate(target, name, 8)
                    assert len(ids) == 8
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, log.read_text()[-3000:]
        finally:
            kill_leftovers(proc)

        ray.init(address=cluster.address, namespace=NAMESPACE)
        try:
            assert len([n for n in ray.nodes() if n["Alive"]]) == 2  # the cluster stays up
            with pytest.raises(ValueError):
                ray.get_actor(registry_name("loraplex"), namespace=NAMESPACE)
            from ray import serve
            assert "loraplex" not in serve.status().applications
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()
