#!/usr/bin/env python
"""Baseline: raw aiormq confirmed, pipelined batch publish (the stack's floor).

Same job as aiopika_min_producer.py one layer down: no aio-pika objects,
just basic.publish frames on a confirm-mode channel with a bounded number
of unconfirmed publishes, persistent messages, durable queue.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import aiormq
import aiormq.exceptions
from pamqp.commands import Basic


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="amqp://guest:guest@localhost:5672/")
    parser.add_argument("--queue", default="task_queue")
    parser.add_argument("--window", type=int, default=256, help="publishes in flight awaiting a confirm")
    return parser.parse_args()


async def publish(args: argparse.Namespace, lines: list[str]) -> int:
    connection = await aiormq.connect(args.url)
    failed = 0
    try:
        channel = await connection.channel(publisher_confirms=True)
        await channel.queue_declare(args.queue, durable=True)
        todo = iter(lines)

        async def lane() -> None:
            nonlocal failed
            for line in todo:
                try:
                    confirm = await channel.basic_publish(
                        line.encode(),
                        routing_key=args.queue,
                        properties=Basic.Properties(delivery_mode=2),
                        mandatory=True,
                    )
                except aiormq.exceptions.DeliveryError:
                    failed += 1
                    continue
                if not isinstance(confirm, Basic.Ack):
                    failed += 1

        await asyncio.gather(*(lane() for _ in range(max(1, args.window))))
    finally:
        await connection.close()
    return failed


def main() -> int:
    args = parse_args()
    lines = [line for line in sys.stdin.read().splitlines() if line.strip()]
    failed = asyncio.run(publish(args, lines))
    print(f" [x] Sent {len(lines) - failed} tasks", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
