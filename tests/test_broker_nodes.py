"""Quick checks of the private-broker harness in broker_nodes.py."""

from __future__ import annotations

import asyncio
import socket
import time

import aio_pika
import pytest
from broker_nodes import BrokerError, BrokerNode, cluster_url, running_cluster

pytestmark = pytest.mark.private_broker

QUEUE = "harness_durable"


async def publish_persistent(url: str, body: bytes) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()  # publisher confirms are on by default
        await channel.declare_queue(QUEUE, durable=True)
        await channel.default_exchange.publish(
            aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            routing_key=QUEUE,
        )


async def get_one(url: str) -> bytes | None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(QUEUE, durable=True)
        message = await queue.get(no_ack=True, fail=False)
        return None if message is None else message.body


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@pytest.mark.timeout(120)
def test_restart_keeps_durable_queue_and_persistent_message() -> None:
    with BrokerNode() as node:
        assert node.name.endswith("@localhost")
        assert node.name != "rabbit@localhost"
        assert node.port != 5672
        asyncio.run(publish_persistent(node.url, b"survives restart"))
        assert node.queue_messages(QUEUE) == 1

        node.restart()

        assert node.running
        assert node.queue_messages(QUEUE) == 1
        assert asyncio.run(get_one(node.url)) == b"survives restart"
        assert node.queue_messages(QUEUE) == 0


@pytest.mark.timeout(120)
def test_kill_9_then_start_recovers_confirmed_message() -> None:
    with BrokerNode() as node:
        asyncio.run(publish_persistent(node.url, b"survives kill -9"))
        pid = node.beam_pid
        assert pid is not None

        asyncio.run(node.akill())  # same as node.kill(), from async code

        assert not node.running
        assert not port_open(node.port)
        with pytest.raises(FileNotFoundError):
            open(f"/proc/{pid}/environ", "rb").close()

        asyncio.run(node.astart())
        assert node.beam_pid != pid
        assert asyncio.run(get_one(node.url)) == b"survives kill -9"


@pytest.mark.timeout(120)
def test_close_all_connections_and_cleanup() -> None:
    node = BrokerNode()
    try:
        node.start()

        async def scenario() -> None:
            connection = await aio_pika.connect(node.url)
            closed = asyncio.Event()
            connection.close_callbacks.add(lambda *_: closed.set())
            await asyncio.to_thread(node.close_all_connections, "harness test")
            await asyncio.wait_for(closed.wait(), 10)  # broker sent Connection.Close 320

        asyncio.run(scenario())
    finally:
        pid, data_dir = node.beam_pid, node.data_dir
        node.cleanup()
    assert not node.running
    assert not data_dir.exists()
    assert pid is not None
    assert not open_proc(pid)


def open_proc(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_refuses_shared_node_name() -> None:
    with pytest.raises(ValueError, match="shared broker"):
        BrokerNode("rabbit@localhost")
    with pytest.raises(ValueError, match="shared broker"):
        BrokerNode("rabbit")


@pytest.mark.timeout(120)
def test_start_failure_reports_log_tail() -> None:
    node = BrokerNode(extra_config="this is = not valid rabbitmq.conf\n", start_timeout=60)
    try:
        with pytest.raises(BrokerError) as info:
            node.start()
        assert node.name in str(info.value)
        assert "---" in str(info.value)  # log tails are included
        assert not node.running
    finally:
        node.cleanup()


@pytest.mark.timeout(120)
def test_three_node_cluster() -> None:
    started = time.monotonic()
    with running_cluster(3) as nodes:
        elapsed = time.monotonic() - started
        print(f"3-node cluster ready in {elapsed:.1f}s")
        names = sorted(node.name for node in nodes)
        for node in nodes:
            assert node.running_nodes() == names
        assert cluster_url(nodes).count("amqp://") == 3
        # a durable queue declared on node 1 is visible through node 3
        asyncio.run(publish_persistent(nodes[0].url, b"clustered"))
        assert nodes[2].queue_messages(QUEUE) == 1
        assert asyncio.run(get_one(nodes[2].url)) == b"clustered"
    for node in nodes:
        assert not node.running
