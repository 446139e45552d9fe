#!/usr/bin/env python
"""Baseline: the least aio-pika code that does the worker's job.

Plain (non-robust) connection, basic.qos prefetch, durable queue, a
callback per delivery that sleeps dots*dot_seconds and then acks. No
reconnects, no failure policy: the lower bound that tasks_worker.py is
measured against. On SIGTERM or Ctrl+C it takes no more tasks, lets those
under way finish and be acked, and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import aio_pika


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="amqp://guest:guest@localhost:5672/")
    parser.add_argument("--queue", default="task_queue")
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--dot-seconds", type=float, default=1.0)
    return parser.parse_args()


async def consume(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)

    connection = await aio_pika.connect(args.url)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=args.prefetch)
        queue = await channel.declare_queue(args.queue, durable=True)

        running: set[asyncio.Task[object]] = set()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            task = asyncio.current_task()
            assert task is not None
            running.add(task)
            try:
                body = message.body
                print(f" [x] Received {body.decode(errors='replace')!r}", flush=True)
                await asyncio.sleep(body.count(b".") * args.dot_seconds)
                print(" [x] Done", flush=True)
                await message.ack()
            finally:
                running.discard(task)

        consumer_tag = await queue.consume(on_message)
        print(" [*] Waiting for messages. To exit press CTRL+C", flush=True)
        await stop.wait()
        # Take no more, let the tasks under way finish and be acked.
        await queue.cancel(consumer_tag)
        if running:
            await asyncio.wait(running)


def main() -> int:
    asyncio.run(consume(parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
