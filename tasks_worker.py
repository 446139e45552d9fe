#!/usr/bin/env python
"""Do the tasks that new_task.py queues: the worker of RabbitMQ tutorial two.

Each '.' in a task stands for a second of work. Run two or more to share it.

    python tasks_worker.py
"""

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
from dataclasses import dataclass
from typing import NoReturn

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue, AbstractRobustConnection
from aio_pika.exceptions import (
    AMQPError,
    ChannelInvalidStateError,
    ChannelPreconditionFailed,
    ProbableAuthenticationError,
)
from pamqp.common import Arguments
from yarl import URL

DEFAULT_URL = "amqp://guest:guest@localhost/"
CONNECT_TIMEOUT = 5.0
RECONNECT_INTERVAL = 2.0
# A quorum queue counts deliveries itself: past this many redeliveries the
# broker moves a failing task to "<queue>.failed" instead of requeueing it.
QUORUM_DELIVERY_LIMIT = 1


class TaskFailed(Exception):
    """What --fail-on and --fail-once-on make a task raise."""


@dataclass(frozen=True)
class Settings:
    channel: AbstractChannel
    dot_seconds: float
    fail_on: bytes | None
    fail_once_on: bytes | None
    failed_queue: str
    quorum: bool


async def on_message(message: AbstractIncomingMessage, settings: Settings) -> None:
    # requeue=True: a task stopped halfway (Ctrl+C, SIGTERM, an unexpected
    # error) goes back to the queue, as the tutorial promises; aio-pika's
    # default would drop it. The ack is sent on leaving the block, after the work.
    async with message.process(requeue=True, ignore_processed=True):
        print(f" [x] Received {shown(message.body)}", flush=True)
        try:
            await asyncio.sleep(message.body.count(b".") * settings.dot_seconds)
            if settings.fail_on and settings.fail_on in message.body:
                raise TaskFailed(f"it contains {settings.fail_on.decode()!r}")
            if settings.fail_once_on and settings.fail_once_on in message.body and not message.redelivered:
                raise TaskFailed(f"it contains {settings.fail_once_on.decode()!r} on a first delivery")
        except Exception as error:
            await retry_or_park(message, error, settings)
            return
        print(" [x] Done", flush=True)


async def retry_or_park(message: AbstractIncomingMessage, error: Exception, settings: Settings) -> None:
    """Requeue a failed task once; when it fails again, move it aside so it cannot loop."""
    task, reason = shown(message.body), f"{type(error).__name__}: {error}"
    if settings.quorum:
        delivery_count = message.headers.get("x-delivery-count") or 0
        last_attempt = isinstance(delivery_count, int) and delivery_count >= QUORUM_DELIVERY_LIMIT
    else:
        last_attempt = bool(message.redelivered)
    if not last_attempt:
        say(f" [!] Task {task} failed ({reason}); back to the queue for one more attempt")
        await message.nack(requeue=True)
    elif settings.quorum:
        # Past the queue's delivery limit the broker dead-letters the task.
        say(f" [!] Task {task} failed again ({reason}); RabbitMQ moves it to queue {settings.failed_queue!r}")
        await message.nack(requeue=True)
    else:
        # Declared again in case someone deleted it since the start. Then copy
        # first, ack second: a crash in between leaves the task in both queues,
        # never in neither, and a copy the broker cannot place raises (the
        # channel has on_return_raises), so the task is requeued, not acked.
        await settings.channel.declare_queue(settings.failed_queue, durable=True)
        await settings.channel.default_exchange.publish(
            # The copy keeps what identifies the task to its producer; not its
            # expiration, which could drop it from the parking queue.
            aio_pika.Message(
                message.body,
                headers={**message.headers, "x-failure": reason},
                content_type=message.content_type,
                content_encoding=message.content_encoding,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                priority=message.priority,
                correlation_id=message.correlation_id,
                reply_to=message.reply_to,
                message_id=message.message_id,
                timestamp=message.timestamp,
                type=message.type,
                app_id=message.app_id,
            ),
            routing_key=settings.failed_queue,
            mandatory=True,
        )
        await message.ack()
        say(f" [!] Task {task} failed again ({reason}); moved to queue {settings.failed_queue!r}")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def shown(body: bytes) -> str:
    """The task as the tutorial prints it: the repr of its text (of its bytes if not UTF-8)."""
    try:
        text: str | bytes = body.decode()
    except UnicodeDecodeError:
        text = body
    quoted = repr(text)
    return quoted if len(quoted) <= 200 else f"{quoted[:200]}... ({len(body)} bytes)"


class FailoverConnection(aio_pika.RobustConnection):
    """A robust connection that moves to the next broker address at every reconnect."""

    def __init__(self, addresses: list[URL], first: int) -> None:
        super().__init__(addresses[first], reconnect_interval=RECONNECT_INTERVAL)
        self.addresses = addresses[first:] + addresses[:first]
        self.attempts = 0
        self.close_callbacks.add(self.report_loss)
        self.reconnect_callbacks.add(self.report_return)

    def where(self) -> str:
        return f"{self.url.host}:{self.url.port or 5672}"

    def report_loss(self, _: object, error: BaseException | None) -> None:
        # Only a connection that was up has a transport here: a failed first
        # attempt, or each failed attempt to reconnect, is not a new loss.
        if self.transport is not None and not self.close_called:
            say(f" [!] Lost the connection to {self.where()} ({error}); reconnecting")

    def report_return(self, _: object) -> None:
        say(f" [*] Reconnected to {self.where()}")

    # aio-pika (10.1.1 and later) runs this before every connection attempt,
    # which then reads self.url; the cluster test fails if that changes.
    async def _RobustConnection__connect_transport(self) -> None:
        self.url = self.addresses[self.attempts % len(self.addresses)]
        self.attempts += 1
        await super()._RobustConnection__connect_transport()  # type: ignore[misc]

    @classmethod
    async def open(cls, addresses: list[URL], first: int) -> "FailoverConnection":
        connection = cls(addresses, first)
        try:
            await connection.connect(timeout=CONNECT_TIMEOUT)
        except BaseException:
            await connection.close()
            raise
        return connection


async def connect(addresses: list[URL]) -> AbstractRobustConnection:
    for first in range(len(addresses) - 1):
        with contextlib.suppress(ConnectionError, OSError, TimeoutError):
            return await FailoverConnection.open(addresses, first)
    return await FailoverConnection.open(addresses, len(addresses) - 1)


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


def queue_arguments(queue: str, queue_type: str) -> Arguments:
    if queue_type == "classic":
        return None
    return {
        "x-queue-type": "quorum",
        "x-delivery-limit": QUORUM_DELIVERY_LIMIT,
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": f"{queue}.failed",
    }


class UserError(Exception):
    """A problem the user can fix; its text is the one line we print."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}; see --help\n")


def prefetch_count(text: str) -> int:
    count = int(text)
    if not 0 <= count <= 65535:
        raise ValueError(text)
    return count


def at_least_zero(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError(text)
    return value


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--url",
        action="append",
        help="broker URL, or several tried in order, comma-separated or repeated "
        f"(default: $AMQP_URL, else {DEFAULT_URL})",
    )
    parser.add_argument("--queue", default="task_queue", help="queue name (default: %(default)s)")
    parser.add_argument(
        "--queue-type",
        choices=("classic", "quorum"),
        default="classic",
        help="classic, as the tutorial, or quorum for a cluster (default: %(default)s)",
    )
    parser.add_argument(
        "--prefetch",
        type=prefetch_count,
        metavar="N",
        default=1,
        help="tasks run at once; 1 is fair dispatch, 0 is no limit (default: %(default)s)",
    )
    parser.add_argument(
        "--dot-seconds",
        type=at_least_zero,
        default=1.0,
        help="seconds of work per '.' (default: %(default)s)",
    )
    parser.add_argument(
        "--grace-seconds",
        type=at_least_zero,
        default=8.0,
        help="on SIGTERM, time the running tasks get to finish (default: %(default)s)",
    )
    parser.add_argument(
        "--fail-on", metavar="TEXT", help="tasks containing TEXT fail, to try the failure policy"
    )
    parser.add_argument("--fail-once-on", metavar="TEXT", help="tasks containing TEXT fail on first delivery")
    return parser.parse_args(argv)


async def start_consuming(
    connection: AbstractRobustConnection, args: argparse.Namespace, running: set["asyncio.Task[None]"]
) -> tuple[AbstractQueue, str]:
    channel = await connection.channel(on_return_raises=True)
    # prefetch_count=1 is fair dispatch: the broker holds back a worker's
    # next task until it acks the current one, and gives it to an idle worker.
    await channel.set_qos(prefetch_count=args.prefetch)
    # The same declaration as new_task.py's: durable, so the queue outlives
    # a broker restart, and whichever side starts first creates it.
    queue = await channel.declare_queue(
        args.queue, durable=True, arguments=queue_arguments(args.queue, args.queue_type)
    )
    failed_queue = f"{args.queue}.failed"
    await channel.declare_queue(
        failed_queue,
        durable=True,
        arguments={"x-queue-type": "quorum"} if args.queue_type == "quorum" else None,
    )
    settings = Settings(
        channel=channel,
        dot_seconds=args.dot_seconds,
        fail_on=args.fail_on.encode() if args.fail_on else None,
        fail_once_on=args.fail_once_on.encode() if args.fail_once_on else None,
        failed_queue=failed_queue,
        quorum=args.queue_type == "quorum",
    )

    async def track(message: AbstractIncomingMessage) -> None:
        task = asyncio.current_task()
        assert task is not None
        running.add(task)
        try:
            await on_message(message, settings)
        finally:
            running.discard(task)

    return queue, await queue.consume(track)


async def first_signal() -> signal.Signals:
    loop = asyncio.get_running_loop()
    # Further signals wait unread in the queue: the first one decides.
    signals: asyncio.Queue[signal.Signals] = asyncio.Queue()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, signals.put_nowait, signum)
    print(" [*] Waiting for messages. To exit press CTRL+C", flush=True)
    return await signals.get()


async def stop_consuming(
    queue: AbstractQueue, consumer_tag: str, running: set["asyncio.Task[None]"], signum: int, grace: float
) -> None:
    # Whatever happens next, unacked tasks go back to the queue: the broker
    # requeues them when we nack them, or when the channel closes.
    with contextlib.suppress(AMQPError, ChannelInvalidStateError, ConnectionError):
        await queue.cancel(consumer_tag)
    if signum == signal.SIGTERM:
        print(f" [*] Terminated: taking no new tasks, {len(running)} running get up to {grace} s", flush=True)
        if running:
            await asyncio.wait(running, timeout=grace)
    unfinished = list(running)
    for task in unfinished:
        task.cancel()
    await asyncio.gather(*unfinished, return_exceptions=True)
    word = "Interrupted" if signum == signal.SIGINT else "Stopped"
    print(f" [*] {word}; unfinished tasks returned to the queue: {len(unfinished)}", flush=True)


async def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    addresses = broker_addresses(args.url or [os.environ.get("AMQP_URL", DEFAULT_URL)])
    running: set[asyncio.Task[None]] = set()
    try:
        connection = await connect(addresses)
        async with connection:
            queue, consumer_tag = await start_consuming(connection, args, running)
            signum = await first_signal()
            await stop_consuming(queue, consumer_tag, running, signum, args.grace_seconds)
    except (AMQPError, ConnectionError, OSError, TimeoutError) as error:
        raise UserError(explain(error, addresses, args.queue)) from None
    return 0


if __name__ == "__main__":
    # The libraries log each reconnection step, and a failed reject on a
    # closed channel (the broker requeues that task by itself); our own
    # lines say what matters, once.
    logging.disable(logging.ERROR)
    try:
        sys.exit(asyncio.run(main()))
    except UserError as error:
        sys.exit(f"error: {error}")
    except KeyboardInterrupt:
        print(" [*] Interrupted before the worker was ready", flush=True)
