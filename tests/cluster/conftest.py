"""The cluster fixture: three RabbitMQ nodes in network namespaces (``tests/cluster/netns.py``).

Only ``make test-cluster`` collects this directory (``pyproject.toml`` keeps
it out of the default run). Without root, ``ip``, ``nft`` or the RabbitMQ
server scripts, the fixture skips with one line saying which is missing.
The finalizer removes the nodes, the namespaces, the bridge and every
partition rule, whether the tests passed or failed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import pytest

from octo_common.transport import WORKER_POLICY_NAME, WORKER_POLICY_PATTERN
from octo_worker.daemon.topology import policy_definition

from .netns import Cluster, missing_requirements


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    missing = missing_requirements()
    if missing is not None:
        pytest.skip(f"the RabbitMQ cluster test {missing}")
    made = Cluster.plan(tmp_path_factory.mktemp("cluster"))
    try:
        made.build_network()
        seconds = made.start()
        sys.stderr.write(f"\ncluster: 3 nodes up and joined in {seconds:.1f} s\n")
        # The production policy of the worker queues (what `octo-worker topology
        # declare` sets): a frame redelivered too often is dead-lettered.
        made.nodes[0].ctl(
            "set_policy",
            "--apply-to",
            "queues",
            WORKER_POLICY_NAME,
            WORKER_POLICY_PATTERN,
            json.dumps(policy_definition()),
        )
        yield made
    except BaseException:
        for node in made.nodes:
            sys.stderr.write(f"--- {node.name} log tail ---\n{node.logs()}\n")
        raise
    finally:
        made.destroy()
