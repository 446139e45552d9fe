#!/usr/bin/env python
"""Baseline: the least aio-pika code for a confirmed, pipelined batch publish.

Reads one task per line from stdin (blank lines skipped), publishes each as
a persistent message to a durable queue on a channel with publisher
confirms, keeping at most --window publishes awaiting their confirm at
once. Exit 0 only when every message was confirmed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import aio_pika


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="amqp://guest:guest@localhost:5672/")
    parser.add_argument("--queue", default="task_queue")
    parser.add_argument("--window", type=int, default=256, help="publishes in flight awaiting a confirm")
    return parser.parse_args()


async def publish(args: argparse.Namespace, lines: list[str]) -> int:
    connection = await aio_pika.connect(args.url)
    failed = 0
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(args.queue, durable=True)
        exchange = channel.default_exchange
        todo = iter(lines)

        async def lane() -> None:
            # Each lane keeps one publish in flight: --window lanes make the window.
            nonlocal failed
            for line in todo:
                message = aio_pika.Message(line.encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
                try:
                    await exchange.publish(message, routing_key=args.queue)
                except aio_pika.exceptions.DeliveryError:
                    failed += 1

        await asyncio.gather(*(lane() for _ in range(max(1, args.window))))
    return failed


def main() -> int:
    args = parse_args()
    lines = [line for line in sys.stdin.read().splitlines() if line.strip()]
    failed = asyncio.run(publish(args, lines))
    print(f" [x] Sent {len(lines) - failed} tasks", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
