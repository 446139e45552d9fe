"""Shared harness: a real RabbitMQ, the scripts run as a reader runs them, fresh queue names.

Tests wait on the scripts' output lines (events), never on fixed sleeps.
"""

import asyncio
import contextlib
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import aio_pika
import pytest

if TYPE_CHECKING:
    from broker_nodes import BrokerNode

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_URL = "amqp://guest:guest@localhost:5672/"
WAITING_LINE = " [*] Waiting for messages. To exit press CTRL+C"
HOW_TO_GET_A_BROKER = (
    "no RabbitMQ answered at {url}: start one with `docker compose up -d --wait` "
    "or `rabbitmq-server -detached`, or set AMQP_URL"
)


async def _handshake(url: str) -> None:
    connection = await aio_pika.connect(url, timeout=3)
    await connection.close()


def broker_answers(url: str, within: float) -> bool:
    deadline = time.monotonic() + within
    while True:
        try:
            asyncio.run(_handshake(url))
            return True
        except Exception:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)


@pytest.fixture(scope="session")
def private_node() -> Iterator["BrokerNode"]:
    """A private RabbitMQ node the tests own, to stop, kill or restart at will (one for
    the session: starting one takes seconds). Tests leave it running or restart it."""
    from broker_nodes import BrokerNode

    node = BrokerNode()
    node.start()
    try:
        yield node
    finally:
        node.cleanup()


def local_rabbitmqctl(*args: str) -> str:
    """rabbitmqctl for the node on this machine that answers on localhost:5672."""
    return subprocess.run(
        ["rabbitmqctl", *args], capture_output=True, text=True, timeout=60, check=True
    ).stdout


@pytest.fixture(scope="session")
def session_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Callable[..., str]]]:
    """A broker that has answered an AMQP handshake, and rabbitmqctl for it:
    AMQP_URL or localhost, else a private node when rabbitmq-server is installed."""
    url = os.environ.get("AMQP_URL", DEFAULT_URL)
    if broker_answers(url, within=10):
        yield url, local_rabbitmqctl
        return
    if shutil.which("rabbitmq-server") is None:
        pytest.fail(HOW_TO_GET_A_BROKER.format(url=url), pytrace=False)
    from broker_nodes import BrokerNode

    node = BrokerNode(base_dir=tmp_path_factory.mktemp("session-broker"))
    node.start()
    try:
        yield node.url, node.ctl
    finally:
        node.cleanup()


@pytest.fixture
def node(private_node: "BrokerNode") -> "BrokerNode":
    """The private node, running: a previous test may have stopped it."""
    if not private_node.running:
        private_node.start()
    return private_node


@pytest.fixture(scope="session")
def broker_url(session_broker: tuple[str, Callable[..., str]]) -> str:
    return session_broker[0]


@pytest.fixture(scope="session")
def rabbitmqctl(session_broker: tuple[str, Callable[..., str]]) -> Callable[..., str]:
    """rabbitmqctl ARGS... against the node behind broker_url; returns its stdout."""
    return session_broker[1]


async def delete_queues(url: str, *names: str) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        for name in names:
            await channel.queue_delete(name)


@pytest.fixture
def queue_name(broker_url: str) -> Iterator[str]:
    """A queue name no other test uses; the queue and its .failed twin are deleted afterwards."""
    name = f"wq-test-{uuid.uuid4().hex[:10]}"
    yield name
    asyncio.run(delete_queues(broker_url, name, f"{name}.failed"))


class Script:
    """One of our scripts running as a subprocess, its output read line by line as it comes."""

    def __init__(self, name: str, *args: str, env: dict[str, str], stdin: bytes | None = None) -> None:
        self.name = name
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / name), *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        if stdin is not None:
            assert self.process.stdin is not None
            self.process.stdin.write(stdin)
            self.process.stdin.close()
        self.stdout_lines: list[str] = []
        self.stderr_lines: list[str] = []
        self._events: queue.Queue[tuple[str, str]] = queue.Queue()
        self._readers = [
            threading.Thread(
                target=self._read, args=(self.process.stdout, "out", self.stdout_lines), daemon=True
            ),
            threading.Thread(
                target=self._read, args=(self.process.stderr, "err", self.stderr_lines), daemon=True
            ),
        ]
        for reader in self._readers:
            reader.start()
        self.returncode: int | None = None

    def _read(self, stream: object, kind: str, into: list[str]) -> None:
        for raw in iter(stream.readline, b""):  # type: ignore[attr-defined]
            line = raw.decode(errors="replace").rstrip("\n")
            into.append(line)
            self._events.put((kind, line))

    def wait_for(self, pattern: str, timeout: float = 30, stream: str = "out") -> str:
        """Wait until a line of stdout (or stderr) matches the regex `pattern`; return it."""
        deadline = time.monotonic() + timeout
        lines = self.stdout_lines if stream == "out" else self.stderr_lines
        index = 0
        while True:
            while index < len(lines):
                if re.search(pattern, lines[index]):
                    return lines[index]
                index += 1
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.name}: no line matching {pattern!r} within {timeout} s;\n"
                    f"stdout: {self.stdout_lines}\nstderr: {self.stderr_lines}\nexit: {self.process.poll()}"
                )
            with contextlib.suppress(queue.Empty):
                self._events.get(timeout=0.05)

    def count(self, pattern: str, stream: str = "out") -> int:
        lines = self.stdout_lines if stream == "out" else self.stderr_lines
        return sum(1 for line in lines if re.search(pattern, line))

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def finish(self, timeout: float = 30) -> int:
        """Wait for the exit, and for the last output lines to be read."""
        self.returncode = self.process.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=5)
        return self.returncode

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def script_env(broker_url: str) -> dict[str, str]:
    return {**os.environ, "AMQP_URL": broker_url, "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def start(script_env: dict[str, str], queue_name: str) -> Iterator[Callable[..., Script]]:
    """Start a script the way a reader does in a shell; every one is stopped after the test.

    It depends on queue_name so that the scripts stop before the queue is deleted:
    a worker still running would declare it again.
    """
    started: list[Script] = []

    def _start(
        name: str, *args: str, env: dict[str, str] | None = None, stdin: bytes | None = None
    ) -> Script:
        script = Script(name, *args, env=env or script_env, stdin=stdin)
        started.append(script)
        return script

    yield _start
    for script in started:
        script.stop()


@pytest.fixture
def run(start: Callable[..., Script]) -> Callable[..., Script]:
    """Run a script to its end (a producer, say) and return it with its output and exit code."""

    def _run(name: str, *args: str, timeout: float = 30, **kwargs: object) -> Script:
        script = start(name, *args, **kwargs)
        script.finish(timeout=timeout)
        return script

    return _run


@pytest.fixture
def start_worker(start: Callable[..., Script], queue_name: str) -> Callable[..., Script]:
    """A tasks_worker.py on this test's queue, returned once it is consuming."""

    def _start_worker(*args: str, **kwargs: object) -> Script:
        worker = start("tasks_worker.py", "--queue", queue_name, *args, **kwargs)
        worker.wait_for(re.escape(WAITING_LINE))
        return worker

    return _start_worker


async def queue_depth(url: str, name: str) -> int:
    """Messages ready in a queue, read through a passive declare from a separate client."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(name, passive=True)
        assert declared.declaration_result.message_count is not None
        return declared.declaration_result.message_count


async def drain(url: str, name: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Take (and ack) every message waiting in a queue, from a separate client."""
    connection = await aio_pika.connect(url)
    taken = []
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(name, passive=True)
        while (message := await declared.get(fail=False)) is not None:
            await message.ack()
            taken.append(message)
    return taken


def depth_is(url: str, name: str, expected: int) -> bool:
    """Whether the queue holds exactly `expected` ready messages: a check for eventually()."""
    return asyncio.run(queue_depth(url, name)) == expected


def received(task: str) -> str:
    """The regex of the worker's line for `task`, as the tutorial prints it."""
    return re.escape(f" [x] Received {task!r}")


def eventually(check: Callable[[], bool], timeout: float = 15, what: str = "condition") -> None:
    """Poll `check` until it holds: for broker state that has no output line to wait on."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(0.1)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In CI (CI=true) a skipped test fails the run: every test here must really run."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if os.environ.get("CI") and skipped:
        reporter.write_line(f"CI: {len(skipped)} test(s) skipped; every test must run here", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
