#!/usr/bin/env python
"""Baseline: the classic blocking pika producer of the Work Queues tutorial.

One connection, durable queue, one persistent message, then exit. With
--confirm the channel is put in confirm mode and the message is published
mandatory, which is what new_task.py promises, so the two can be compared
like for like; without it this is exactly the tutorial's fire-and-forget.
"""

from __future__ import annotations

import argparse
import sys

import pika


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("words", nargs="*")
    parser.add_argument("--url", default="amqp://guest:guest@localhost:5672/")
    parser.add_argument("--queue", default="task_queue")
    parser.add_argument("--confirm", action="store_true", help="wait for the broker's publisher confirm")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    message = " ".join(args.words) or "Hello World!"
    connection = pika.BlockingConnection(pika.URLParameters(args.url))
    channel = connection.channel()
    channel.queue_declare(queue=args.queue, durable=True)
    if args.confirm:
        channel.confirm_delivery()
    channel.basic_publish(
        exchange="",
        routing_key=args.queue,
        body=message.encode(),
        properties=pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent),
        mandatory=args.confirm,
    )
    print(f" [x] Sent {message!r}", flush=True)
    connection.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
