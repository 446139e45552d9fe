#!/usr/bin/env python
"""Send tasks to the queue "hello": the first, naive producer of RabbitMQ tutorial two.

Its tasks are lost when RabbitMQ restarts; new_task.py is the fixed version.

    python new_task_initial.py First message.
"""

import argparse
import asyncio
import logging
import os
import re
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import NoReturn

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection
from aio_pika.exceptions import (
    AMQPError,
    ChannelInvalidStateError,
    ChannelPreconditionFailed,
    ProbableAuthenticationError,
)
from yarl import URL

DEFAULT_URL = "amqp://guest:guest@localhost/"
CONNECT_TIMEOUT = 5.0
# Publishing runs ahead of the socket by at most this many tasks.
CONFIRM_WINDOW = 256


class UserError(Exception):
    """A problem the user can fix; its text is the one line we print."""


def shown(body: bytes) -> str:
    """The task as the tutorial prints it: the repr of its text (of its bytes if not UTF-8)."""
    try:
        text: str | bytes = body.decode()
    except UnicodeDecodeError:
        text = body
    quoted = repr(text)
    return quoted if len(quoted) <= 200 else f"{quoted[:200]}... ({len(body)} bytes)"


def broker_addresses(urls: list[str]) -> list[URL]:
    addresses = []
    for url in (part.strip() for text in urls for part in text.split(",")):
        masked = re.sub(r"(//[^/@:]*:).*@", r"\1****@", url)
        try:
            address = URL(url)
            valid = address.scheme in ("amqp", "amqps") and bool(address.host) and address.port != 0
        except ValueError:
            valid = False
        if not valid:
            raise UserError(
                f"malformed broker URL {masked!r}; write it as amqp://user:password@host:port/vhost"
            )
        addresses.append(address)
    return addresses


def explain(error: BaseException, addresses: list[URL], queue: str) -> str:
    """One line naming what went wrong and how to fix it; never the password."""
    address = addresses[-1]
    where = ", ".join(f"{url.host}:{url.port or 5672}" for url in addresses)
    vhost = address.path[1:] or "/"
    if isinstance(error, ChannelPreconditionFailed):
        found = re.search(r"inequivalent arg '([^']*)'.*: received (.*) but current is (.*)", str(error))
        differs = (
            f"{found[1]}: this script asks for {found[2]}, the queue has {found[3]}" if found else str(error)
        )
        return (
            f"queue {queue!r} already exists with other properties ({differs}; all of them, type included: "
            "`rabbitmqctl list_queues name durable type arguments`); use another name with --queue, "
            f"or delete it once empty with `rabbitmqctl delete_queue {queue}`"
        )
    if isinstance(error, ProbableAuthenticationError):
        return (
            f"RabbitMQ at {where} refused user {address.user!r}: wrong user name or password; "
            "fix them in --url or AMQP_URL"
        )
    if isinstance(error, AMQPError) and "Connection.Close" in str(error):
        return (
            f"RabbitMQ at {where} would not open virtual host {vhost!r}: it does not exist "
            f"or {address.user!r} may not use it; create it with `rabbitmqctl add_vhost {vhost}` "
            f"and `rabbitmqctl set_permissions -p {vhost} {address.user} '.*' '.*' '.*'`, "
            "or fix the URL's path"
        )
    reason = "no answer" if isinstance(error, TimeoutError) else str(error)
    return (
        f"cannot reach RabbitMQ at {where} ({reason}); start it, for example "
        "with `docker compose up -d`, or point --url or AMQP_URL at a running broker"
    )


async def connect(addresses: list[URL]) -> AbstractConnection:
    for address in addresses[:-1]:
        try:
            return await aio_pika.connect(address, timeout=CONNECT_TIMEOUT)
        except (ConnectionError, OSError, TimeoutError):
            continue
    return await aio_pika.connect(addresses[-1], timeout=CONNECT_TIMEOUT)


async def stdin_lines() -> AsyncIterator[tuple[int, bytes]]:
    # A thread reads: a read that blocks the event loop would also hold up the
    # confirms of the tasks already sent. It is a daemon thread, so Ctrl+C
    # need not wait for a pipe that never closes.
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[bytes] = asyncio.Queue(maxsize=4)

    def read_all() -> None:
        while True:
            chunk = os.read(sys.stdin.fileno(), 1 << 16)
            asyncio.run_coroutine_threadsafe(chunks.put(chunk), loop).result()
            if not chunk:
                return

    threading.Thread(target=read_all, daemon=True).start()
    pending, number = b"", 0
    while chunk := await chunks.get():
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            number += 1
            if line.strip():
                yield number, line.rstrip(b"\r")
    if pending.strip():
        yield number + 1, pending.rstrip(b"\r")


async def single_task(body: bytes) -> AsyncIterator[tuple[int, bytes]]:
    yield 1, body


class Progress:
    """Counts tasks, and shows the counts on stderr when a person watches it."""

    def __init__(self) -> None:
        self.read = self.sent = 0
        self.unsent: list[tuple[int, bytes, str]] = []
        self.started = time.monotonic()
        self.shown_at = 0.0
        self.on_terminal = sys.stderr.isatty()

    def show(self, final: bool = False) -> None:
        now = time.monotonic()
        if self.on_terminal and (final or now - self.shown_at >= 0.5):
            self.shown_at = now
            rate = self.sent / max(now - self.started, 1e-9)
            print(
                f"\r {self.read} read, {self.sent} sent, {rate:.0f} tasks/s",
                end="\n" if final else "",
                file=sys.stderr,
                flush=True,
            )


async def publish_tasks(
    channel: AbstractChannel, queue: str, tasks: AsyncIterator[tuple[int, bytes]]
) -> Progress:
    progress = Progress()
    reading = asyncio.Lock()

    # Each lane has one task at a time waiting for the broker; CONFIRM_WINDOW
    # lanes keep that many in flight, with no round trip per task.
    async def lane() -> None:
        while True:
            async with reading:
                task = await anext(tasks, None)
            if task is None:
                return
            number, body = task
            progress.read += 1
            failure = "not written"
            try:
                await channel.default_exchange.publish(aio_pika.Message(body), routing_key=queue)
                failure = ""
            except (AMQPError, ChannelInvalidStateError, ConnectionError):
                failure = "the connection was lost"
            finally:
                if failure:
                    progress.unsent.append((number, body, failure))
                else:
                    progress.sent += 1
                progress.show()

    await asyncio.gather(*(lane() for _ in range(CONFIRM_WINDOW)), return_exceptions=True)
    progress.show(final=True)
    return progress


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}; see --help\n")


async def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "words", nargs="*", help="the task; each '.' is a second of work (default: Hello World!)"
    )
    parser.add_argument(
        "--url",
        action="append",
        help="broker URL, or several tried in order, comma-separated "
        f"or repeated (default: $AMQP_URL, else {DEFAULT_URL})",
    )
    parser.add_argument("--queue", default="hello", help="queue name (default: %(default)s)")
    parser.add_argument("--stdin", action="store_true", help="queue one task per line of standard input")
    args = parser.parse_args(argv)
    if args.stdin and args.words:
        parser.error("--stdin reads the tasks from standard input: give no task words with it")
    addresses = broker_addresses(args.url or [os.environ.get("AMQP_URL", DEFAULT_URL)])
    message = " ".join(args.words) or "Hello World!"

    try:
        connection = await connect(addresses)
        async with connection:
            channel = await connection.channel(publisher_confirms=False)
            await channel.declare_queue(args.queue)
            tasks = stdin_lines() if args.stdin else single_task(message.encode())
            progress = await publish_tasks(channel, args.queue, tasks)
    except (AMQPError, ConnectionError, OSError, TimeoutError) as error:
        raise UserError(explain(error, addresses, args.queue)) from None

    for number, body, failure in sorted(progress.unsent):
        where = f"line {number}" if args.stdin else "task"
        print(f"error: {where} not sent ({failure}): {shown(body)}", file=sys.stderr)
    if progress.unsent:
        return 1
    print(f" [x] Sent {progress.sent} tasks" if args.stdin else f" [x] Sent {message!r}")
    return 0


if __name__ == "__main__":
    # The library's own log lines would repeat, as tracebacks, the one-line
    # error we print.
    logging.disable(logging.ERROR)
    try:
        sys.exit(asyncio.run(main()))
    except UserError as error:
        sys.exit(f"error: {error}")
    except KeyboardInterrupt:
        sys.exit("error: interrupted; a task without its ' [x] Sent' line may not be queued")
