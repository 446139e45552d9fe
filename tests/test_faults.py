"""The tutorial's promises under real faults: a worker killed, a broker restarted or
crashed, connections cut, a broker down, messages from a foreign producer.

Worker deaths and foreign messages use the shared broker; everything that stops or
restarts a broker uses one private node (tests/broker_nodes.py), started once for
this module. Each test writes its figures to tests/.figures/ (see reliability_table.py).
"""

from __future__ import annotations

import asyncio
import datetime
import decimal
import re
import signal
import time
import uuid
from collections.abc import Callable

import aio_pika
import pytest
from broker_nodes import BrokerNode
from conftest import WAITING_LINE, Script, eventually, received
from reliability_table import record, record_done, tally

SLOW_TASK_SECONDS = "2"


def lost_line(node: BrokerNode) -> str:
    return rf"^ \[!\] Lost the connection to 127\.0\.0\.1:{node.port} \(.*\); reconnecting$"


def reconnected_line(node: BrokerNode) -> str:
    return rf"^ \[\*\] Reconnected to 127\.0\.0\.1:{node.port}$"


def first_to_print(scripts: list[Script], pattern: str, timeout: float = 30) -> Script:
    """The script that prints a line matching `pattern` first (fair dispatch picks the worker)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for script in scripts:
            if script.count(pattern):
                return script
        time.sleep(0.02)
    raise AssertionError(f"no script printed {pattern!r} within {timeout} s")


def kill_9(script: Script) -> None:
    script.process.kill()
    assert script.finish() == -signal.SIGKILL


def no_tracebacks(*scripts: Script) -> None:
    for script in scripts:
        assert not [line for line in script.stderr_lines if "Traceback" in line], script.stderr_lines


# ----------------------------------------------------------------- a worker dies


@pytest.mark.timeout(60)
def test_unacked_task_is_redelivered_after_kill(start_worker, run, queue_name, request):
    workers = [start_worker("--dot-seconds", SLOW_TASK_SECONDS) for _ in range(2)]
    body = "A task that takes a while."
    assert run("new_task.py", "--queue", queue_name, body).returncode == 0

    victim = first_to_print(workers, received(body))
    (survivor,) = (worker for worker in workers if worker is not victim)
    kill_9(victim)

    survivor.wait_for(received(body))
    survivor.wait_for(re.escape(" [x] Done"))
    _, done = tally(workers)
    assert victim.count(re.escape(" [x] Done")) == 0
    assert done == {repr(body): 1}
    record_done(
        request.node.name,
        fault="worker killed mid-task",
        how="kill -9 of the worker holding the task",
        sent=1,
        done=done,
    )


@pytest.mark.timeout(60)
def test_prefetched_task_survives_a_killed_worker(start_worker, run, queue_name, request):
    # A worker that takes two tasks at once, and would need a minute for each.
    holder = start_worker("--prefetch", "2", "--dot-seconds", "60")
    bodies = ["held 1.", "held 2.", "waiting 3."]
    sent = run("new_task.py", "--queue", queue_name, "--stdin", stdin="\n".join(bodies).encode())
    assert sent.stdout_lines == [" [x] Sent 3 tasks"]
    eventually(lambda: holder.count(r"^ \[x\] Received") == 2, what="the holder took two tasks")

    kill_9(holder)
    rescuer = start_worker("--dot-seconds", "0.01")
    eventually(lambda: rescuer.count(re.escape(" [x] Done")) == 3, what="the rescuer finished all three")

    received_counts, done = tally([holder, rescuer])
    assert done == {repr(body): 1 for body in bodies}
    assert sorted(received_counts) == sorted(repr(body) for body in bodies)
    record_done(
        request.node.name,
        fault="worker killed holding 2 prefetched tasks",
        how="kill -9 of a worker at --prefetch 2",
        sent=len(bodies),
        done=done,
    )


# ----------------------------------------------------------------- foreign messages

NOW = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
# Headers another client may send: names the broker and this worker use, with
# values of the wrong type, and every AMQP field type.
ODD_HEADERS = {
    "x-delivery-count": "not a number",
    "x-death": "not a list",
    "x-failure": 42,
    "nested": {"list": [1, 2.5, True, None, bytearray(b"\xff raw")], "empty": {}},
    "price": decimal.Decimal("9.99"),
    "when": NOW,
    "big": 2**62,
    "negative": -1,
}


async def publish_foreign(url: str, queue: str, messages: list[aio_pika.Message], redelivered: bytes) -> None:
    """Publish as another application might, and hand one task back unacked once."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, durable=True)
        await channel.default_exchange.publish(aio_pika.Message(redelivered), routing_key=queue)
        taken = await declared.get(timeout=10)
        assert taken.body == redelivered
        await taken.nack(requeue=True)  # back at the head of the queue, flagged redelivered
        for message in messages:
            await channel.default_exchange.publish(message, routing_key=queue)


@pytest.mark.timeout(60)
def test_foreign_properties_and_a_redelivered_task_never_kill_the_worker(
    start_worker, broker_url, queue_name, request
):
    messages = [
        aio_pika.Message(b'{"task": "json."}', content_type="application/json", content_encoding="gzip"),
        aio_pika.Message(b"urgent.", priority=9, expiration=60),
        aio_pika.Message(
            b"all the properties.",
            content_type="text/plain",
            content_encoding="utf-8",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            priority=0,
            correlation_id="c-1",
            reply_to="nowhere",
            expiration=3600,
            message_id="m-1",
            timestamp=NOW,
            type="report",
            user_id="guest",
            app_id="some-other-app",
        ),
        aio_pika.Message(b"odd headers.", headers=ODD_HEADERS),
    ]
    redelivered = b"handed back once."
    asyncio.run(publish_foreign(broker_url, queue_name, messages, redelivered))

    worker = start_worker("--dot-seconds", "0.01", "--fail-once-on", "handed back")
    bodies = [redelivered.decode(), *(message.body.decode() for message in messages)]
    eventually(lambda: worker.count(re.escape(" [x] Done")) == len(bodies), what="every task Done")

    received_counts, done = tally([worker])
    # The redelivered flag alone does not make a task fail or be parked.
    assert received_counts == {repr(body): 1 for body in bodies}
    assert done == {repr(body): 1 for body in bodies}
    assert worker.process.poll() is None
    no_tracebacks(worker)
    record_done(
        request.node.name,
        fault="foreign producer's properties, a redelivered task",
        how="content type, priority, expiration, odd headers, redelivered flag",
        sent=len(bodies),
        done=done,
    )


IDENTIFYING_PROPERTIES = (
    "content_type",
    "content_encoding",
    "priority",
    "correlation_id",
    "reply_to",
    "message_id",
    "timestamp",
    "type",
    "app_id",
)


async def publish_and_read_failed(url: str, queue: str, message: aio_pika.Message, worker: Script) -> dict:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.default_exchange.publish(message, routing_key=queue)
        await asyncio.to_thread(worker.wait_for, rf"moved to queue '{re.escape(queue)}\.failed'$", 30, "err")
        failed = await channel.declare_queue(f"{queue}.failed", passive=True)
        parked = await failed.get(timeout=10)
        await parked.ack()
        assert await failed.get(fail=False) is None
        return {
            "body": parked.body,
            "headers": parked.headers,
            "delivery_mode": parked.delivery_mode,
            "expiration": parked.expiration,
            **{name: getattr(parked, name) for name in IDENTIFYING_PROPERTIES},
        }


@pytest.mark.timeout(60)
def test_failing_foreign_task_is_parked_with_its_headers(start_worker, broker_url, queue_name, request):
    worker = start_worker("--dot-seconds", "0", "--fail-on", "refused")
    body = b"refused, with odd headers."
    identity = {
        "content_type": "application/x-odd",
        "content_encoding": "identity",
        "priority": 5,
        "correlation_id": "corr-7",
        "reply_to": "replies",
        "message_id": "msg-42",
        "timestamp": datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
        "type": "resize",
        "app_id": "foreign-app",
    }
    message = aio_pika.Message(body, headers=ODD_HEADERS, expiration=600, **identity)

    parked = asyncio.run(publish_and_read_failed(broker_url, queue_name, message, worker))

    assert parked["body"] == body
    # What identifies the task to its producer survives parking; an expiration
    # does not, since it would drop the task from the parking queue.
    assert {name: parked[name] for name in IDENTIFYING_PROPERTIES} == identity
    assert parked["delivery_mode"] == aio_pika.DeliveryMode.PERSISTENT
    assert parked["expiration"] is None
    headers = parked["headers"]
    assert isinstance(headers["x-failure"], str)  # the worker's reason replaces the foreign 42
    assert "refused" in headers["x-failure"]
    for name in ("x-delivery-count", "x-death", "big", "negative", "when", "price"):
        assert headers[name] == ODD_HEADERS[name], name
    assert headers["nested"]["list"][:4] == [1, 2.5, True, None]
    assert bytes(headers["nested"]["list"][4]) == b"\xff raw"
    received_counts, done = tally([worker])
    assert received_counts == {repr(body.decode()): 2}
    assert not done
    assert worker.process.poll() is None
    no_tracebacks(worker)
    record(
        request.node.name,
        fault="foreign task that always fails",
        how="--fail-on: parked with its headers in <queue>.failed",
        sent=1,
        completed=0,
        lost=0,  # parked, with its headers, in <queue>.failed
        duplicated=0,
    )


# ----------------------------------------------------------------- the broker fails


@pytest.fixture
def node_env(node: BrokerNode, script_env: dict[str, str]) -> dict[str, str]:
    return {**script_env, "AMQP_URL": node.url}


@pytest.fixture
def private_queue() -> str:
    return f"wq-fault-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def start_private_worker(start, node_env, private_queue) -> Callable[..., Script]:
    def _start(*args: str) -> Script:
        worker = start("tasks_worker.py", "--queue", private_queue, *args, env=node_env)
        worker.wait_for(re.escape(WAITING_LINE))
        return worker

    return _start


@pytest.mark.private_broker
@pytest.mark.timeout(60)
def test_worker_recovers_after_the_connection_is_cut(
    node, node_env, private_queue, start_private_worker, run, request
):
    worker = start_private_worker("--dot-seconds", "1")
    # Five seconds of work: rabbitmqctl takes a second or two to cut the connection.
    cut, after = "cut while working.....", ["next in line", "and the last one"]
    for body in [cut, *after]:
        assert run("new_task.py", "--queue", private_queue, body, env=node_env).returncode == 0
    worker.wait_for(received(cut))

    node.close_all_connections("cut by the test")

    worker.wait_for(lost_line(node), stream="err")
    worker.wait_for(reconnected_line(node), stream="err")
    eventually(lambda: tally([worker])[1].keys() >= {repr(body) for body in [cut, *after]}, timeout=30)
    received_counts, done = tally([worker])
    assert received_counts[repr(cut)] == 2  # redelivered exactly once more
    assert done[repr(cut)] >= 1
    assert all(received_counts[repr(body)] == 1 for body in after)
    assert node.queue_messages(private_queue) == 0
    no_tracebacks(worker)
    record_done(
        request.node.name,
        fault="connection cut mid-task",
        how="rabbitmqctl close_all_connections",
        sent=3,
        done=done,
    )


@pytest.mark.private_broker
@pytest.mark.timeout(90)
def test_persistent_tasks_survive_a_broker_restart_and_transient_ones_do_not(
    node, node_env, private_queue, start, run, request
):
    durable = [f"kept {i}." for i in range(1, 21)]
    transient = [f"forgotten {i}." for i in range(1, 11)]
    hello = f"{private_queue}-hello"
    sent = run(
        "new_task.py", "--queue", private_queue, "--stdin", stdin="\n".join(durable).encode(), env=node_env
    )
    assert sent.stdout_lines == [f" [x] Sent {len(durable)} tasks"]
    sent = run(
        "new_task_initial.py", "--queue", hello, "--stdin", stdin="\n".join(transient).encode(), env=node_env
    )
    assert sent.stdout_lines == [f" [x] Sent {len(transient)} tasks"]
    eventually(lambda: node.queue_messages(hello) == len(transient), what="the transient tasks queued")
    assert node.queue_messages(private_queue) == len(durable)

    node.restart()

    assert node.queue_messages(private_queue) == len(durable)
    assert node.queue_messages(hello) in (None, 0)  # the queue is gone, with its tasks
    worker = start("tasks_worker.py", "--queue", private_queue, "--dot-seconds", "0", env=node_env)
    eventually(lambda: worker.count(re.escape(" [x] Done")) == len(durable), what="the kept tasks done")
    _, done = tally([worker])
    assert done == {repr(body): 1 for body in durable}
    for kind, name, bodies, completed in (
        ("persistent", "durable queue, persistent tasks (new_task.py)", durable, len(done)),
        ("transient", "plain queue (new_task_initial.py), expected loss", transient, 0),
    ):
        record(
            f"{request.node.name}[{kind}]",
            fault=f"broker restart: {name}",
            how="rabbitmqctl stop, then start",
            sent=len(bodies),
            completed=completed,
            lost=len(bodies) - completed,
            duplicated=0,
        )


@pytest.mark.private_broker
@pytest.mark.timeout(90)
def test_worker_reconnects_by_itself_after_a_broker_restart(
    node, node_env, private_queue, start_private_worker, run, request
):
    worker = start_private_worker("--dot-seconds", "0.01")
    before = [f"before {i}." for i in range(1, 4)]
    after = [f"after {i}." for i in range(1, 4)]
    run("new_task.py", "--queue", private_queue, "--stdin", stdin="\n".join(before).encode(), env=node_env)
    eventually(lambda: worker.count(re.escape(" [x] Done")) == len(before), what="the first tasks done")

    node.restart()

    worker.wait_for(lost_line(node), stream="err")
    worker.wait_for(reconnected_line(node), stream="err", timeout=30)
    # One line for the loss, however many attempts the restart took.
    assert worker.count(lost_line(node), stream="err") == 1
    sent = run(
        "new_task.py", "--queue", private_queue, "--stdin", stdin="\n".join(after).encode(), env=node_env
    )
    assert sent.returncode == 0
    eventually(
        lambda: worker.count(re.escape(" [x] Done")) == len(before) + len(after), what="the new tasks done"
    )
    received_counts, done = tally([worker])
    assert received_counts == {repr(body): 1 for body in before + after}  # nothing acked came back
    assert worker.process.poll() is None
    no_tracebacks(worker)
    record_done(
        request.node.name,
        fault="broker restart under a running worker",
        how="rabbitmqctl stop, then start; worker left running",
        sent=len(before) + len(after),
        done=done,
    )


@pytest.mark.private_broker
@pytest.mark.timeout(90)
def test_parked_task_is_still_in_the_failed_queue_after_a_broker_crash(
    node, node_env, private_queue, start_private_worker, run, request
):
    worker = start_private_worker("--dot-seconds", "0", "--fail-on", "poison")
    poison = "poison pill"
    assert run("new_task.py", "--queue", private_queue, poison, env=node_env).returncode == 0
    worker.wait_for(rf"moved to queue '{re.escape(private_queue)}\.failed'$", stream="err")
    assert node.queue_messages(f"{private_queue}.failed") == 1

    node.restart(kill=True)  # kill -9 of the broker, then start on the same data

    worker.wait_for(reconnected_line(node), stream="err", timeout=30)
    assert node.queue_messages(f"{private_queue}.failed") == 1
    assert node.queue_messages(private_queue) == 0  # not looping back to the workers
    parked = asyncio.run(take_one(node.url, f"{private_queue}.failed"))
    assert parked.body == poison.encode()
    assert parked.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    received_counts, _ = tally([worker])
    assert received_counts == {repr(poison): 2}
    record(
        request.node.name,
        fault="broker crash with a parked task",
        how="kill -9 of the broker, then start",
        sent=1,
        completed=0,
        lost=0,  # parked in <queue>.failed, where it stays
        duplicated=0,
    )


async def take_one(url: str, queue: str) -> aio_pika.abc.AbstractIncomingMessage:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        message = await declared.get(timeout=10)
        await message.ack()
        return message


@pytest.mark.private_broker
@pytest.mark.timeout(60)
def test_new_task_while_broker_down_fails_cleanly(node, private_queue, run, request):
    node.stop()

    sent = run("new_task.py", "--url", node.url, "--queue", private_queue, "x")

    assert sent.returncode == 1
    assert sent.stdout_lines == []
    assert len(sent.stderr_lines) == 1
    assert sent.stderr_lines[0].startswith(f"error: cannot reach RabbitMQ at 127.0.0.1:{node.port} ")
    record(
        request.node.name,
        fault="broker down when a task is sent",
        how="rabbitmqctl stop; new_task.py exits 1, one error line",
        sent=0,
        completed=0,
        lost=0,
        duplicated=0,
    )
