"""Stopping the worker: Ctrl+C gives unfinished tasks back, SIGTERM lets running ones finish first.

The tutorial's promise is that a task is never lost when its worker dies: whatever was
not acked goes back to the queue for another worker.
"""

import asyncio
import contextlib
import re
import signal
import socket
import threading
from collections.abc import Iterator

import aio_pika
import pytest
from conftest import WAITING_LINE, depth_is, drain, eventually

LONG_TASK = "A long task" + "." * 30


async def publish(url: str, queue: str, body: str) -> None:
    """Queue a persistent task from a separate client and wait for the broker's confirm."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.default_exchange.publish(
            aio_pika.Message(body.encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            routing_key=queue,
        )


def test_ctrl_c_requeues_the_unfinished_task(start_worker, run, queue_name, broker_url):
    worker = start_worker("--dot-seconds", "1")
    assert run("new_task.py", "--queue", queue_name, LONG_TASK).returncode == 0
    worker.wait_for(re.escape(f" [x] Received {LONG_TASK!r}"))

    worker.signal(signal.SIGINT)
    # The task would take 30 s: exiting well before that means the worker
    # did not wait for it.
    assert worker.finish(timeout=10) == 0
    assert worker.stdout_lines[-1] == " [*] Interrupted; unfinished tasks returned to the queue: 1"
    assert worker.stderr_lines == []

    eventually(lambda: depth_is(broker_url, queue_name, 1), what="the task back in the queue")
    [task] = asyncio.run(drain(broker_url, queue_name))
    assert task.body == LONG_TASK.encode()
    assert task.redelivered


def test_ctrl_c_when_idle_exits_cleanly(start_worker):
    worker = start_worker("--dot-seconds", "0.01")
    worker.signal(signal.SIGINT)
    assert worker.finish(timeout=10) == 0
    assert worker.stdout_lines == [
        WAITING_LINE,
        " [*] Interrupted; unfinished tasks returned to the queue: 0",
    ]
    assert worker.stderr_lines == []


def test_sigterm_when_idle_exits_cleanly(start_worker):
    worker = start_worker("--dot-seconds", "0.01", "--grace-seconds", "10")
    worker.signal(signal.SIGTERM)
    # Nothing runs, so nothing is waited for: far sooner than the grace period.
    assert worker.finish(timeout=8) == 0
    assert worker.stdout_lines == [
        WAITING_LINE,
        " [*] Terminated: taking no new tasks, 0 running get up to 10.0 s",
        " [*] Stopped; unfinished tasks returned to the queue: 0",
    ]
    assert worker.stderr_lines == []


def test_sigterm_lets_the_running_task_finish(start_worker, run, queue_name, broker_url):
    # --prefetch 2: a worker still consuming would take the second task at
    # once, even while busy with the first.
    worker = start_worker("--dot-seconds", "0.5", "--grace-seconds", "10", "--prefetch", "2")
    first, second = "First task....", "Second task."
    assert run("new_task.py", "--queue", queue_name, first).returncode == 0
    worker.wait_for(re.escape(f" [x] Received {first!r}"))

    worker.signal(signal.SIGTERM)
    worker.wait_for(r"^ \[\*\] Terminated")
    asyncio.run(publish(broker_url, queue_name, second))
    # The claim is about a worker that is still alive when the task arrives.
    assert " [x] Done" not in worker.stdout_lines, "the first task ended before the second was queued"

    assert worker.finish(timeout=20) == 0
    after_waiting = worker.stdout_lines[worker.stdout_lines.index(WAITING_LINE) + 1 :]
    assert after_waiting[0] == f" [x] Received {first!r}"
    assert after_waiting[1].startswith(" [*] Terminated")
    assert after_waiting[2:] == [
        " [x] Done",
        " [*] Stopped; unfinished tasks returned to the queue: 0",
    ]
    assert worker.stderr_lines == []

    # The first task was acked; the second one waits for another worker.
    waiting = asyncio.run(drain(broker_url, queue_name))
    assert [task.body for task in waiting] == [second.encode()]


def test_sigterm_requeues_what_outlives_the_grace_period(start_worker, run, queue_name, broker_url):
    worker = start_worker("--dot-seconds", "1", "--grace-seconds", "0.5")
    assert run("new_task.py", "--queue", queue_name, LONG_TASK).returncode == 0
    worker.wait_for(re.escape(f" [x] Received {LONG_TASK!r}"))

    worker.signal(signal.SIGTERM)
    assert worker.finish(timeout=10) == 0
    assert worker.stdout_lines[-1] == " [*] Stopped; unfinished tasks returned to the queue: 1"
    assert worker.count(r"Traceback", stream="err") == 0
    assert worker.stderr_lines == []

    eventually(lambda: depth_is(broker_url, queue_name, 1), what="the task back in the queue")
    [task] = asyncio.run(drain(broker_url, queue_name))
    assert task.body == LONG_TASK.encode()


@contextlib.contextmanager
def silent_listener() -> Iterator[tuple[int, threading.Event]]:
    """A loopback TCP port that accepts a connection and never answers it: the AMQP handshake hangs.

    The event is set once the client has sent its protocol header, that is, while it
    waits for the broker's first word.
    """
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(30)
    greeted = threading.Event()
    accepted: list[socket.socket] = []

    def serve() -> None:
        try:
            connection, _ = server.accept()
        except OSError:
            return
        accepted.append(connection)
        received = b""
        with contextlib.suppress(OSError):
            while len(received) < 8 and (chunk := connection.recv(8)):
                received += chunk
        if received.startswith(b"AMQP"):
            greeted.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], greeted
    finally:
        for connection in accepted:
            connection.close()
        server.close()


def test_ctrl_c_during_startup_is_clean(start, queue_name):
    with silent_listener() as (port, greeted):
        worker = start(
            "tasks_worker.py", "--url", f"amqp://guest:guest@127.0.0.1:{port}/", "--queue", queue_name
        )
        assert greeted.wait(timeout=20), "the worker never started its AMQP handshake"
        worker.signal(signal.SIGINT)
        assert worker.finish(timeout=10) == 0
    assert worker.stdout_lines == [" [*] Interrupted before the worker was ready"]
    assert worker.stderr_lines == []


@pytest.mark.parametrize("name", ["new_task_initial.py", "new_task.py"])
def test_ctrl_c_stops_a_producer_with_one_line(start, name, queue_name):
    with silent_listener() as (port, greeted):
        producer = start(
            name, "--url", f"amqp://guest:guest@127.0.0.1:{port}/", "--queue", queue_name, "Lost?"
        )
        assert greeted.wait(timeout=20), "the producer never started its AMQP handshake"
        producer.signal(signal.SIGINT)
        assert producer.finish(timeout=10) == 1
    assert producer.stdout_lines == []
    assert producer.stderr_lines == [
        "error: interrupted; a task without its ' [x] Sent' line may not be queued"
    ]
