"""Performance features: many tasks per producer run (--stdin), many tasks per worker (--prefetch N).

Speed must not cost correctness: every line is either queued in order or
reported by its number, and a worker running several tasks still acks each
one only after its work.
"""

import asyncio
import contextlib
import os
import pty
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

import aio_pika
import pytest
from conftest import ROOT, delete_queues, drain, eventually, queue_depth

SENT_ONE = re.compile(r"^ \[x\] Sent ")


def batch_input() -> tuple[bytes, list[bytes]]:
    """1000 lines, some blank or only spaces, some ending in CR, the last without a newline."""
    lines, expected = [], []
    for number in range(1, 1001):
        if number % 10 == 5:
            line = ""
        elif number % 37 == 0:
            line = "   "
        else:
            line = f"task {number}" + "." * (number % 4)
            expected.append(line.encode())
            if number % 50 == 1:
                line += "\r"
        lines.append(line)
    return "\n".join(lines).encode(), expected


async def depth_or_none(url: str, name: str) -> int | None:
    """Ready messages in the queue, or None while it does not exist."""
    try:
        return await queue_depth(url, name)
    except aio_pika.exceptions.ChannelNotFoundEntity:
        return None


def batch_cut_in_two(
    script: str,
    queue: str,
    env: dict[str, str],
    url: str,
    first: bytes,
    between: Callable[[], None],
    rest: bytes,
) -> tuple[int, bytes, bytes]:
    """Run `script --stdin`, feed it `first`, wait until the broker holds those
    lines, run `between` (the fault), then feed `rest` and close its input."""
    producer = subprocess.Popen(
        [sys.executable, str(ROOT / script), "--queue", queue, "--stdin"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert producer.stdin is not None
        producer.stdin.write(first)
        producer.stdin.flush()
        eventually(
            lambda: asyncio.run(depth_or_none(url, queue)) == first.count(b"\n"),
            timeout=20,
            what="the first lines queued",
        )
        between()
        stdout, stderr = producer.communicate(rest, timeout=30)
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()
    return producer.returncode, stdout, stderr


@pytest.fixture
def full_after_two(queue_name: str, rabbitmqctl) -> Iterator[str]:
    """A policy on this test's queue only: it holds 2 tasks and refuses (nacks) any more."""
    rabbitmqctl(
        "-q",
        "set_policy",
        "--apply-to",
        "queues",
        "--priority",
        "100",
        queue_name,
        f"^{re.escape(queue_name)}$",
        '{"max-length": 2, "overflow": "reject-publish"}',
    )
    try:
        yield queue_name
    finally:
        rabbitmqctl("-q", "clear_policy", queue_name)


# --- new_task.py --stdin ----------------------------------------------------------------------


def test_stdin_batch_queues_every_line(run, broker_url, queue_name):
    text, expected = batch_input()
    sent = run("new_task.py", "--queue", queue_name, "--stdin", stdin=text)
    assert sent.returncode == 0, sent.stderr_lines
    assert sent.stdout_lines == [f" [x] Sent {len(expected)} tasks"]
    # stderr is a pipe here, not a person: no progress noise.
    assert sent.stderr_lines == []
    assert asyncio.run(queue_depth(broker_url, queue_name)) == len(expected)
    messages = asyncio.run(drain(broker_url, queue_name))
    assert [message.body for message in messages] == expected
    assert {message.delivery_mode for message in messages} == {aio_pika.DeliveryMode.PERSISTENT}


def test_stdin_batch_reports_nacked_lines(run, broker_url, full_after_two):
    queue_name = full_after_two
    long_line = "seven" + "." * 300
    lines = [b"one", b"two", b"three", b" ", b"\xff\xfe five", b"six", long_line.encode()]
    sent = run("new_task.py", "--queue", queue_name, "--stdin", stdin=b"\n".join(lines) + b"\n")
    assert sent.returncode == 1
    assert not any(SENT_ONE.match(line) for line in sent.stdout_lines), sent.stdout_lines
    # One line each, in input order, quoted as the worker quotes tasks (bytes
    # if not UTF-8, long ones cut short). Line 4 is only a space: not a task,
    # so not reported either.
    nacked = "not sent (refused by the broker (nack))"
    assert sent.stderr_lines == [
        f"error: line 3 {nacked}: 'three'",
        f"error: line 5 {nacked}: b'\\xff\\xfe five'",
        f"error: line 6 {nacked}: 'six'",
        f"error: line 7 {nacked}: {repr(long_line)[:200]}... ({len(long_line)} bytes)",
    ]
    assert asyncio.run(queue_depth(broker_url, queue_name)) == 2

    # The single-task form says the same of its one task.
    single = run("new_task.py", "--queue", queue_name, "Too", "many.")
    assert single.returncode == 1
    assert single.stdout_lines == []
    assert single.stderr_lines == ["error: task not sent (refused by the broker (nack)): 'Too many.'"]

    assert [message.body for message in asyncio.run(drain(broker_url, queue_name))] == [b"one", b"two"]


def test_stdin_batch_reports_unroutable_lines(script_env, broker_url, queue_name):
    # The queue vanishes between two lines: the broker returns line 2 (mandatory,
    # no queue to route it to), and the producer says so instead of dropping it.
    returncode, stdout, stderr = batch_cut_in_two(
        "new_task.py",
        queue_name,
        script_env,
        broker_url,
        b"first line.\n",
        lambda: asyncio.run(delete_queues(broker_url, queue_name)),
        b"second line..\n",
    )
    assert returncode == 1, (stdout, stderr)
    assert stdout == b""
    errors = stderr.decode().splitlines()
    assert len(errors) == 1, errors
    assert re.fullmatch(
        r"error: line 2 not sent \(returned by the broker: .*NO_ROUTE.*\): 'second line\.\.'", errors[0]
    ), errors


@pytest.mark.parametrize("script", ["new_task.py", "new_task_initial.py"])
def test_stdin_progress_is_shown_on_a_terminal(script_env, queue_name, script):
    # A person watching a long batch sees counts and a rate; stdout keeps the summary.
    count = 3000
    text = "".join(f"task {number}.\n" for number in range(count)).encode()
    controller, terminal = pty.openpty()
    try:
        producer = subprocess.Popen(
            [sys.executable, str(ROOT / script), "--queue", queue_name, "--stdin"],
            cwd=ROOT,
            env=script_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=terminal,
        )
        os.close(terminal)
        terminal = -1
        stdout, _ = producer.communicate(text, timeout=60)
        shown = b""
        with contextlib.suppress(OSError):  # EIO once the terminal's last writer is gone
            while chunk := os.read(controller, 4096):
                shown += chunk
    finally:
        os.close(controller)
        if terminal != -1:
            os.close(terminal)
    assert producer.returncode == 0, shown
    assert stdout.decode().splitlines() == [f" [x] Sent {count} tasks"]
    screen = shown.decode()
    assert re.search(r"\d+ read, \d+ sent, \d+ tasks/s", screen), screen
    final = screen.replace("\r\n", "\n").rstrip("\n").split("\r")[-1]
    assert re.fullmatch(rf" {count} read, {count} sent, \d+ tasks/s", final), screen


# --- new_task_initial.py --stdin ----------------------------------------------------------------


def test_new_task_initial_batch(run, broker_url, queue_name):
    sent = run(
        "new_task_initial.py", "--queue", queue_name, "--stdin", stdin=b"First.\n\nSecond..\n  \nThird..."
    )
    assert sent.returncode == 0, sent.stderr_lines
    assert sent.stdout_lines == [" [x] Sent 3 tasks"]
    assert sent.stderr_lines == []
    messages = asyncio.run(drain(broker_url, queue_name))
    assert [message.body for message in messages] == [b"First.", b"Second..", b"Third..."]
    assert all(message.delivery_mode != aio_pika.DeliveryMode.PERSISTENT for message in messages)


# --- tasks_worker.py --prefetch N ---------------------------------------------------------------


def worker_events(worker) -> list[str]:
    """R for each Received line, D for each Done line, in output order."""
    return [
        "R" if line.startswith(" [x] Received") else "D"
        for line in worker.stdout_lines
        if line.startswith(" [x] Received") or line == " [x] Done"
    ]


def test_prefetch_n_runs_n_tasks_at_once(start_worker, run, queue_name):
    tasks = b"one.\ntwo.\nthree.\n"
    # Queued first, so the worker finds all three waiting.
    assert run("new_task.py", "--queue", queue_name, "--stdin", stdin=tasks).returncode == 0
    three = start_worker("--prefetch", "3", "--dot-seconds", "0.3")
    eventually(lambda: three.count(re.escape(" [x] Done")) == 3, what="three done")
    assert worker_events(three) == ["R", "R", "R", "D", "D", "D"]
    three.signal(signal.SIGINT)
    assert three.finish() == 0

    # One at a time with prefetch 1, the tutorial's fair-dispatch setting.
    assert run("new_task.py", "--queue", queue_name, "--stdin", stdin=tasks).returncode == 0
    one = start_worker("--prefetch", "1", "--dot-seconds", "0.3")
    eventually(lambda: one.count(re.escape(" [x] Done")) == 3, what="three done")
    assert worker_events(one) == ["R", "D", "R", "D", "R", "D"]


def test_unacked_tasks_are_all_redelivered_after_kill_with_prefetch(
    start_worker, run, broker_url, queue_name
):
    # Three tasks at once, still each acked only after its own work: a worker
    # killed while running them leaves all three to the broker.
    worker = start_worker("--prefetch", "3", "--dot-seconds", "1")
    tasks = b"".join(f"long task {n}".encode() + b"." * 60 + b"\n" for n in range(3))
    assert run("new_task.py", "--queue", queue_name, "--stdin", stdin=tasks).returncode == 0
    eventually(lambda: worker.count(r" \[x\] Received") == 3, what="three received")
    assert asyncio.run(queue_depth(broker_url, queue_name)) == 0
    worker.signal(signal.SIGKILL)
    worker.finish()
    assert worker.count(re.escape(" [x] Done")) == 0
    eventually(lambda: asyncio.run(queue_depth(broker_url, queue_name)) == 3, what="all three requeued")
    messages = asyncio.run(drain(broker_url, queue_name))
    assert sorted(message.body for message in messages) == sorted(tasks.splitlines())
    assert all(message.redelivered for message in messages)


def close_connection_named(rabbitmqctl, name: str) -> None:
    """Close, from the broker's side, the client connection that calls itself `name`."""
    listing = rabbitmqctl("-q", "--no-table-headers", "list_connections", "pid", "client_properties")
    pids = [line.split("\t")[0] for line in listing.splitlines() if name in line]
    assert len(pids) == 1, listing
    rabbitmqctl("-q", "close_connection", pids[0], "test: connection cut mid-batch")


@pytest.mark.parametrize("script", ["new_task.py", "new_task_initial.py"])
def test_stdin_batch_reports_every_line_not_sent_when_the_connection_drops(
    script_env, broker_url, queue_name, script, rabbitmqctl
):
    # The broker cuts the producer off between two lines. Nothing may vanish:
    # every line is either in the queue or named on stderr.
    name = f"{queue_name}-producer"
    env = {**script_env, "AMQP_URL": f"{broker_url.rstrip('/')}/?name={name}"}
    returncode, stdout, stderr = batch_cut_in_two(
        script,
        queue_name,
        env,
        broker_url,
        b"line 1\nline 2\n",
        lambda: close_connection_named(rabbitmqctl, name),
        b"line 3\nline 4\n",
    )
    assert returncode == 1, (stdout, stderr)
    assert b" [x] Sent" not in stdout
    queued = [message.body for message in asyncio.run(drain(broker_url, queue_name))]
    assert queued == [b"line 1", b"line 2"]
    errors = stderr.decode().splitlines()
    assert [
        re.match(r"error: (line \d) not sent \(the connection was lost\): ", error)[1] for error in errors
    ] == [
        "line 3",
        "line 4",
    ], errors
