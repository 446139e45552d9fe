#!/usr/bin/env python
"""Baseline: the classic blocking pika worker of the Work Queues tutorial.

Durable queue, fair dispatch through basic.qos, one message at a time, the
ack is sent only after the simulated work (one sleep per dot in the body).
Used by bench/run.py as the reference consumer; prints the same progress
lines as tasks_worker.py so the harness can count them.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time

import pika


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="amqp://guest:guest@localhost:5672/")
    parser.add_argument("--queue", default="task_queue")
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--dot-seconds", type=float, default=1.0)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    # SIGTERM lets the task under way finish and be acked, then stops; when
    # no task is under way it stops at once. Ctrl+C stops at once either way.
    state = {"busy": False, "stopping": False}

    def on_sigterm(signum: int, frame: object) -> None:
        state["stopping"] = True
        if not state["busy"]:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    connection = pika.BlockingConnection(pika.URLParameters(args.url))
    channel = connection.channel()
    channel.queue_declare(queue=args.queue, durable=True)
    channel.basic_qos(prefetch_count=args.prefetch)

    def on_message(ch, method, properties, body: bytes) -> None:
        state["busy"] = True
        try:
            print(f" [x] Received {body.decode(errors='replace')!r}", flush=True)
            time.sleep(body.count(b".") * args.dot_seconds)
            print(" [x] Done", flush=True)
            ch.basic_ack(delivery_tag=method.delivery_tag)
        finally:
            state["busy"] = False
        if state["stopping"]:
            ch.stop_consuming()

    channel.basic_consume(queue=args.queue, on_message_callback=on_message)
    print(" [*] Waiting for messages. To exit press CTRL+C", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        channel.start_consuming()
    # The connection may already be gone; then there is nothing to release.
    with contextlib.suppress(Exception):
        connection.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
