"""The tutorial's claims, one per test, checked on a real RabbitMQ.

Each test drives the scripts as a reader does (subprocesses, their output lines)
and looks at the broker from outside: a separate aio-pika client, or rabbitmqctl,
the tool the tutorial itself uses to show unacknowledged messages.
"""

import asyncio
import re
import signal

import aio_pika
import pytest
from conftest import drain, eventually, queue_depth


def ready_and_unacked(rabbitmqctl, name: str) -> tuple[int, int] | None:
    """The tutorial's debugging view of a queue: its ready and unacknowledged message counts.

    `rabbitmqctl list_queues name messages_ready messages_unacknowledged`
    """
    listing = rabbitmqctl(
        "-q", "list_queues", "--no-table-headers", "name", "messages_ready", "messages_unacknowledged"
    )
    for line in listing.splitlines():
        name_found, ready, unacked = line.split("\t")
        if name_found == name:
            return int(ready), int(unacked)
    return None


def received_lines(script) -> list[str]:
    return [line for line in script.stdout_lines if line.startswith(" [x] Received")]


async def is_durable(url: str, name: str) -> bool:
    """Whether the existing queue is durable: RabbitMQ refuses a declaration that differs."""
    connection = await aio_pika.connect(url)
    async with connection:
        for durable in (True, False):
            channel = await connection.channel()
            try:
                await channel.declare_queue(name, durable=durable)
            except aio_pika.exceptions.ChannelPreconditionFailed:
                continue
            return durable
    raise AssertionError(f"queue {name} accepts neither durable=True nor durable=False")


async def publish_raw(url: str, queue: str, messages: list[aio_pika.Message]) -> None:
    """Publish from a client that is none of our scripts, with confirms."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(queue, durable=True)
        for message in messages:
            await channel.default_exchange.publish(message, routing_key=queue)


# --- "Preparation": the naive producer, and the queue "hello" -------------------------------


@pytest.mark.parametrize(
    ("words", "task"),
    [((), "Hello World!"), (("First", "message."), "First message.")],
    ids=["no-words", "words-joined"],
)
def test_hello_world_is_the_default_task(run, broker_url, queue_name, words, task):
    # The naive producer: its task is the words given, joined by spaces, else
    # "Hello World!"; it neither makes the queue durable nor the task persistent.
    sent = run("new_task_initial.py", "--queue", queue_name, *words)
    assert sent.returncode == 0, sent.stderr_lines
    assert sent.stdout_lines == [f" [x] Sent {task!r}"]
    assert sent.stderr_lines == []

    assert asyncio.run(is_durable(broker_url, queue_name)) is False
    messages = asyncio.run(drain(broker_url, queue_name))
    assert [message.body for message in messages] == [task.encode()]
    assert messages[0].delivery_mode != aio_pika.DeliveryMode.PERSISTENT


# --- "Message durability" -------------------------------------------------------------------


def test_task_is_persistent_and_queue_durable(run, broker_url, queue_name):
    # Both halves of the tutorial's fix: a durable queue and a persistent message.
    sent = run("new_task.py", "--queue", queue_name, "First", "message.")
    assert sent.returncode == 0, sent.stderr_lines
    assert sent.stdout_lines == [" [x] Sent 'First message.'"]

    assert asyncio.run(is_durable(broker_url, queue_name)) is True
    messages = asyncio.run(drain(broker_url, queue_name))
    assert [message.body for message in messages] == [b"First message."]
    assert messages[0].delivery_mode == aio_pika.DeliveryMode.PERSISTENT


# --- "Message acknowledgment" ---------------------------------------------------------------


def test_busy_worker_task_shows_as_unacknowledged(start_worker, run, queue_name, rabbitmqctl):
    # The tutorial's debugging recipe: `rabbitmqctl list_queues name messages_ready
    # messages_unacknowledged`. A task being worked on is unacknowledged, not ready;
    # once the worker says Done it is neither.
    worker = start_worker("--dot-seconds", "1")
    assert run("new_task.py", "--queue", queue_name, "Hello...").returncode == 0
    worker.wait_for(re.escape(" [x] Received 'Hello...'"))
    eventually(
        lambda: ready_and_unacked(rabbitmqctl, queue_name) == (0, 1), timeout=10, what="0 ready, 1 unacked"
    )
    assert worker.count(re.escape(" [x] Done")) == 0, "the task ended before it was seen unacked"
    worker.wait_for(re.escape(" [x] Done"))
    eventually(
        lambda: ready_and_unacked(rabbitmqctl, queue_name) == (0, 0), timeout=10, what="0 ready, 0 unacked"
    )


def test_task_sent_before_any_worker_is_kept(start_worker, run, broker_url, queue_name):
    # No worker has declared the queue yet: the producer declares it itself,
    # so the task waits there for the first worker.
    assert run("new_task.py", "--queue", queue_name, "Early", "task.").returncode == 0
    assert asyncio.run(queue_depth(broker_url, queue_name)) == 1
    worker = start_worker("--dot-seconds", "0.01")
    worker.wait_for(re.escape(" [x] Received 'Early task.'"))
    worker.wait_for(re.escape(" [x] Done"))
    assert received_lines(worker) == [" [x] Received 'Early task.'"]


# --- "Fair dispatch" ------------------------------------------------------------------------

# The tutorial's example: odd tasks heavy, even ones light. At --dot-seconds
# 0.02 a heavy task takes 0.8 s and a light one 0.02 s.
HEAVY_AND_LIGHT = [f"Task {n} heavy" + "." * 40 if n % 2 else f"Task {n} light." for n in range(1, 9)]
DOT_SECONDS = "0.02"


def task_numbers(worker) -> list[int]:
    return [int(re.search(r"Task (\d+)", line)[1]) for line in received_lines(worker)]  # type: ignore[index]


def most_held_at_once(worker) -> int:
    """The most tasks the worker had received and not yet finished, by its output."""
    held = most = 0
    for line in worker.stdout_lines:
        if line.startswith(" [x] Received"):
            held += 1
            most = max(most, held)
        elif line == " [x] Done":
            held -= 1
    return most


def run_heavy_and_light(start_worker, run, queue_name, prefetch: str):
    workers = [start_worker("--prefetch", prefetch, "--dot-seconds", DOT_SECONDS) for _ in range(2)]
    sent = run("new_task.py", "--queue", queue_name, "--stdin", stdin="\n".join(HEAVY_AND_LIGHT).encode())
    assert sent.stdout_lines == [f" [x] Sent {len(HEAVY_AND_LIGHT)} tasks"]
    eventually(
        lambda: sum(worker.count(re.escape(" [x] Done")) for worker in workers) == len(HEAVY_AND_LIGHT),
        timeout=30,
        what="every task done",
    )
    return workers


def test_fair_dispatch_gives_heavy_and_light_tasks_to_the_idle_worker(start_worker, run, queue_name):
    # prefetch 1: a worker gets its next task only once it has acked the last,
    # so the worker that did light task 2 goes on to heavy task 3 while the
    # other is still busy with heavy task 1; the load is shared.
    workers = run_heavy_and_light(start_worker, run, queue_name, prefetch="1")
    numbers = [task_numbers(worker) for worker in workers]
    assert sorted(numbers[0] + numbers[1]) == list(range(1, 9))
    for worker in workers:
        assert most_held_at_once(worker) == 1, worker.stdout_lines
    light_taker = next(worker_numbers for worker_numbers in numbers if 2 in worker_numbers)
    assert 3 in light_taker, numbers
    # Both workers share the heavy tasks, where round-robin leaves them all to one.
    for worker_numbers in numbers:
        assert any(n % 2 for n in worker_numbers), numbers


def test_without_prefetch_limit_dispatch_is_blind_round_robin(start_worker, run, queue_name):
    # prefetch 0 (no limit): the broker hands every n-th task to the n-th
    # worker as it arrives, whatever they are busy with: one worker gets all
    # the heavy tasks, the other all the light ones.
    workers = run_heavy_and_light(start_worker, run, queue_name, prefetch="0")
    numbers = sorted(task_numbers(worker) for worker in workers)
    assert numbers == [[1, 3, 5, 7], [2, 4, 6, 8]] or numbers == [[2, 4, 6, 8], [1, 3, 5, 7]]
    heavy_worker = next(w for w in workers if task_numbers(w)[0] % 2)
    assert most_held_at_once(heavy_worker) > 1


# --- Robustness: whatever the body, the worker survives and acks ----------------------------


def test_any_body_neither_crashes_the_worker_nor_is_lost(start_worker, broker_url, queue_name):
    big = b"x" * (5 * 1024 * 1024)
    dots = b"." * 5000
    messages = [
        aio_pika.Message(b"", delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
        aio_pika.Message(b"\xff\xfe not utf-8", delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
        aio_pika.Message(big, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
        aio_pika.Message(dots, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
        aio_pika.Message(
            b"With properties.",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            content_type="text/plain",
            priority=7,
            expiration=3600,
            headers={"origin": "test", "attempt": 1},
        ),
    ]
    worker = start_worker("--dot-seconds", "0.00001")
    asyncio.run(publish_raw(broker_url, queue_name, messages))
    eventually(lambda: worker.count(re.escape(" [x] Done")) == len(messages), timeout=30, what="all done")

    assert received_lines(worker) == [
        " [x] Received ''",
        " [x] Received b'\\xff\\xfe not utf-8'",
        f" [x] Received '{'x' * 199}... ({len(big)} bytes)",
        f" [x] Received '{'.' * 199}... ({len(dots)} bytes)",
        " [x] Received 'With properties.'",
    ]
    assert worker.process.poll() is None, "the worker died"
    assert not any("Traceback" in line for line in worker.stderr_lines), worker.stderr_lines
    assert worker.stderr_lines == []
    # Stop it: any task left unacked would go back to the queue now.
    worker.signal(signal.SIGINT)
    assert worker.finish() == 0
    assert worker.stdout_lines[-1] == " [*] Interrupted; unfinished tasks returned to the queue: 0"
    assert asyncio.run(queue_depth(broker_url, queue_name)) == 0


# --- Usage ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "options"),
    [
        ("new_task_initial.py", ["--url", "--queue", "--stdin"]),
        ("new_task.py", ["--url", "--queue", "--queue-type", "--stdin"]),
        (
            "tasks_worker.py",
            [
                "--url",
                "--queue",
                "--queue-type",
                "--prefetch",
                "--dot-seconds",
                "--grace-seconds",
                "--fail-on",
                "--fail-once-on",
            ],
        ),
    ],
)
def test_help_for_each_script(run, script, options):
    shown = run(script, "--help")
    assert shown.returncode == 0
    assert shown.stderr_lines == []
    text = "\n".join(shown.stdout_lines)
    assert text.startswith("usage: "), text
    for option in options:
        assert re.search(rf"^\s+{re.escape(option)}\b", text, re.MULTILINE), f"{option} missing:\n{text}"
