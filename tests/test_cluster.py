"""A worker on a three-node RabbitMQ cluster with a quorum queue carries on when its node stops."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator

import pytest
from broker_nodes import BrokerNode, cleanup_nodes, cluster_url, start_cluster
from conftest import WAITING_LINE, eventually, queue_depth
from reliability_table import record_done, tally

pytestmark = pytest.mark.private_broker


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[BrokerNode]]:
    nodes = start_cluster(3)
    try:
        yield nodes
    finally:
        cleanup_nodes(nodes)


@pytest.mark.timeout(90)
def test_worker_carries_on_through_another_node_of_a_quorum_cluster(cluster, start, run, script_env, request):
    first, *others = cluster
    env = {**script_env, "AMQP_URL": cluster_url(cluster)}
    queue = f"wq-cluster-{uuid.uuid4().hex[:10]}"
    bodies = [f"cluster task {n:02d}." for n in range(1, 41)]
    sent = run(
        "new_task.py", "--queue", queue, "--queue-type", "quorum", "--stdin",
        stdin="\n".join(bodies).encode(), env=env,
    )  # fmt: skip
    assert sent.stdout_lines == [f" [x] Sent {len(bodies)} tasks"]
    worker = start(
        "tasks_worker.py", "--queue", queue, "--queue-type", "quorum", "--dot-seconds", "0.15", env=env
    )
    worker.wait_for(re.escape(WAITING_LINE))
    eventually(lambda: worker.count(re.escape(" [x] Done")) >= 5, what="the worker under way")

    first.stop()  # the worker's node: it connects to the first address of the list

    worker.wait_for(rf"^ \[!\] Lost the connection to 127\.0\.0\.1:{first.port} ", stream="err")
    done_when_lost = len(tally([worker])[1])
    other_ports = "|".join(str(node.port) for node in others)
    worker.wait_for(rf"^ \[\*\] Reconnected to 127\.0\.0\.1:({other_ports})$", stream="err", timeout=30)
    eventually(
        lambda: tally([worker])[1].keys() >= {repr(body) for body in bodies},
        timeout=45,
        what="every task done",
    )
    received, done = tally([worker])
    assert done_when_lost < len(bodies), "the node stopped after the work was over: nothing was shown"
    assert done.keys() == {repr(body) for body in bodies}
    # Through AMQP: `rabbitmqctl list_queues` shows quorum queue counts seconds late.
    assert asyncio.run(queue_depth(others[0].url, queue)) == 0
    assert worker.process.poll() is None
    assert not [line for line in worker.stderr_lines if "Traceback" in line], worker.stderr_lines
    record_done(
        request.node.name,
        fault="cluster node stopped under the worker",
        how="3 nodes, quorum queue; rabbitmqctl stop of the worker's node",
        sent=len(bodies),
        done=done,
    )
    print(
        f"cluster: {done_when_lost} tasks done before the node stopped, {sum(received.values())} deliveries"
    )
