#!/usr/bin/env python
"""Measure the Work Queues scripts side by side with their baselines.

    python bench/run.py [--quick] [--url URL] [--rst | --markdown] [--only NAME ...]

Every figure is the median of several repetitions, and every comparison is
against a baseline measured in the same run, in interleaved order, on the
same broker: the machine is shared and noisy, so only ratios mean anything.
Timings never fail the run. The exit status is 1 only when something is
broken: a script missing or exiting non-zero, a task lost or duplicated, a
queue left in an unexpected state, a run that stalls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import platform
import resource
import shlex
import signal
import statistics
import sys
import tempfile
import textwrap
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import aiormq
from pamqp.commands import Basic

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PY = sys.executable
DEFAULT_URL = "amqp://guest:guest@localhost:5672/"
# Without progress for this long a measurement is declared stalled (broken).
STALL_SECONDS = 30.0


class Broken(Exception):
    """Something is wrong beyond slowness: the run must exit non-zero."""


# --------------------------------------------------------------------------
# Results


@dataclass
class Row:
    figure: str
    unit: str
    ours: float | None
    baseline_name: str
    baseline: float | None
    # ">=" when bigger is better (rates), "<=" when smaller is (times, memory).
    op: str = ">="
    target: float | None = None
    ours_samples: list[float] = field(default_factory=list)
    baseline_samples: list[float] = field(default_factory=list)
    # Paired: sample i of ours and of the baseline come from the same repetition,
    # one right after the other, so each pair saw much the same machine load.
    paired: bool = False

    @property
    def ratio(self) -> float | None:
        """Ours over the baseline; when paired, the median of the per-repetition ratios."""
        if self.ours is None or not self.baseline:
            return None
        if self.paired and self.ours_samples and len(self.ours_samples) == len(self.baseline_samples):
            pairs = zip(self.ours_samples, self.baseline_samples, strict=True)
            return statistics.median(o / b for o, b in pairs)
        return self.ours / self.baseline

    @property
    def met(self) -> bool | None:
        if self.target is None or self.ratio is None:
            return None
        return self.ratio >= self.target if self.op == ">=" else self.ratio <= self.target


def fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "tasks/s":
        return f"{value:,.0f} tasks/s"
    if unit == "ms":
        return f"{value:.0f} ms"
    if unit == "s":
        return f"{value:.2f} s"
    if unit == "us":
        return f"{value:.0f} µs"
    if unit == "MiB":
        return f"{value:.1f} MiB"
    return f"{value:.3g} {unit}"


def fmt_ratio(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.0f}x" if value >= 100 else f"{value:.2f}x"


def table_cells(rows: Sequence[Row]) -> tuple[list[str], list[list[str]]]:
    header = ["figure", "ours", "baseline", "ratio", "target", "met?"]
    body = []
    for row in rows:
        target = "—" if row.target is None else f"{row.op} {fmt_ratio(row.target)}"
        met = {True: "yes", False: "NO", None: "—"}[row.met]
        body.append(
            [
                row.figure,
                fmt_value(row.ours, row.unit),
                f"{row.baseline_name}: {fmt_value(row.baseline, row.unit)}",
                fmt_ratio(row.ratio),
                target,
                met,
            ]
        )
    return header, body


def render_text(rows: Sequence[Row]) -> str:
    header, body = table_cells(rows)
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in body]
    return "\n".join(lines)


def render_markdown(rows: Sequence[Row]) -> str:
    header, body = table_cells(rows)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in body]
    return "\n".join(lines)


def render_rst(rows: Sequence[Row]) -> str:
    """A list-table: its cells wrap, so the README stays readable in a narrow window."""
    header, body = table_cells(rows)
    lines = [".. list-table::", "   :header-rows: 1", ""]
    for cells in [header, *body]:
        lines.append(f"   * - {cells[0]}")
        lines.extend(f"     - {cell}" for cell in cells[1:])
    return "\n".join(lines)


def machine_summary(broker_version: str, url: str) -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for text in Path("/proc/cpuinfo").read_text().splitlines():
            if text.startswith("model name"):
                cpu = text.split(":", 1)[1].strip()
                break
    host = urllib.parse.urlsplit(url).hostname or "localhost"
    where = "on the same machine" if host in ("localhost", "127.0.0.1", "::1") else "on another host"
    return (
        f"{os.cpu_count()} cores ({cpu}), Linux {platform.release()}, Python {platform.python_version()}, "
        f"RabbitMQ {broker_version} {where}"
    )


LEGEND = (
    "ratio is ours over the baseline; where both were measured in the same repetitions it is the "
    "median of the per-repetition ratios, so a pair shares the machine's load of the moment. "
    "target is the ratio aimed at and met? says whether the median reached it: a missed target "
    "never fails the run, only something broken (a lost task, a script failing) does."
)


def report(rows: Sequence[Row], style: str, command: str, machine: str, today: str, wall: float) -> str:
    intro = (
        f"Measured {today} on a shared, noisy machine: {machine}. Each figure is the median of several "
        "repetitions and each ratio compares with a baseline measured in the same run, so read the "
        "ratios rather than the absolute numbers."
    )
    outro = f"The whole run took {wall:.0f} s."
    if style == "rst":
        title = "Performance"
        return "\n".join(
            [
                title,
                "-" * len(title),
                "",
                textwrap.fill(intro + " Reproduce with::", 100),
                "",
                f"    {command}",
                "",
                render_rst(rows),
                "",
                textwrap.fill(f"{LEGEND} {outro}", 100),
                "",
            ]
        )
    if style == "markdown":
        return "\n".join(
            [
                "## Performance",
                "",
                textwrap.fill(f"{intro} Reproduce with `{command}`.", 100),
                "",
                render_markdown(rows),
                "",
                textwrap.fill(f"{LEGEND} {outro}", 100),
                "",
            ]
        )
    return "\n".join(
        [f"{today}, {machine}", f"$ {command}", "", render_text(rows), "", f"wall time {wall:.1f} s", ""]
    )


# --------------------------------------------------------------------------
# Broker side: the harness's own connection, for queues and pre-filling


class Broker:
    def __init__(self, url: str) -> None:
        self.url = url
        self.connection: aiormq.abc.AbstractConnection | None = None
        self.channel: aiormq.abc.AbstractChannel | None = None
        self.version = "?"
        self.queues: set[str] = set()

    async def open(self) -> None:
        self.connection = await aiormq.connect(self.url)
        props = self.connection.server_properties or {}
        version = props.get("version", "?")
        self.version = version.decode() if isinstance(version, bytes) else str(version)
        self.channel = await self.connection.channel(publisher_confirms=True)

    async def ready_channel(self) -> aiormq.abc.AbstractChannel:
        """The harness's channel, reopened if the shared broker cut it (others test there too)."""
        if self.connection is None or self.connection.is_closed:
            await self.open()
        elif self.channel is None or self.channel.is_closed:
            assert self.connection is not None
            self.channel = await self.connection.channel(publisher_confirms=True)
        assert self.channel is not None
        return self.channel

    async def call(self, method: str, *args: object, **kwargs: object) -> object:
        """One idempotent channel method, tried once more on a fresh channel if the first was cut."""
        for attempt in (1, 2):
            channel = await self.ready_channel()
            try:
                return await getattr(channel, method)(*args, **kwargs)
            except (aiormq.exceptions.ConnectionClosed, aiormq.exceptions.ChannelInvalidStateError):
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def close(self) -> None:
        for name in list(self.queues):
            with contextlib.suppress(Exception):
                await self.delete(name)
        if self.connection is not None:
            await self.connection.close()

    def new_queue(self, figure: str) -> str:
        name = f"bench.{figure}.{uuid.uuid4().hex[:10]}"
        # The worker creates "<queue>.failed" for its failure policy.
        self.queues.update({name, f"{name}.failed"})
        return name

    async def declare(self, name: str) -> None:
        await self.call("queue_declare", name, durable=True)

    async def depth(self, name: str) -> int:
        """Messages ready in the queue (unacked ones count once their consumer is gone)."""
        ok = await self.call("queue_declare", name, passive=True)
        assert isinstance(ok, aiormq.spec.Queue.DeclareOk)
        return int(ok.message_count or 0)

    async def delete(self, name: str) -> None:
        for queue in (name, f"{name}.failed"):
            self.queues.discard(queue)
            await self.call("queue_delete", queue)

    async def fill(self, name: str, bodies: Sequence[bytes], window: int = 256) -> None:
        """Publish persistent messages with confirms, a bounded number in flight."""
        channel = await self.ready_channel()
        todo = iter(bodies)
        refused = 0

        async def lane() -> None:
            nonlocal refused
            for body in todo:
                confirm = await channel.basic_publish(
                    body, routing_key=name, properties=Basic.Properties(delivery_mode=2), mandatory=True
                )
                if not isinstance(confirm, Basic.Ack):
                    refused += 1

        await asyncio.gather(*(lane() for _ in range(window)))
        if refused:
            raise Broken(f"pre-filling {name}: {refused} messages not confirmed")


# --------------------------------------------------------------------------
# Child processes


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far."""
    # The command name, field 2, is in parentheses and may hold spaces.
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, in KiB."""
    values = {}
    for text in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = text.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0])
    return values["VmRSS"], values["VmHWM"]


class Child:
    """A script run as a subprocess whose progress lines are timestamped as they arrive."""

    running: ClassVar[set[Child]] = set()

    def __init__(self, name: str, argv: list[str], on_done: Callable[[], None] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.on_done = on_done
        self.proc: asyncio.subprocess.Process | None = None
        self.started = 0.0
        self.ready_at: float | None = None
        self.first_received: float | None = None
        self.last_done: float | None = None
        self.received = 0
        self.done = 0
        self.last_progress = 0.0
        self.stdout: list[bytes] = []
        self.stderr = b""
        self.rss_at: set[int] = set()
        self.rss_samples: list[tuple[int, int, int]] = []
        # (tasks done, CPU seconds): taken at the first delivery and on demand.
        self.cpu_marks: list[tuple[int, float]] = []
        self._changed = asyncio.Event()
        self._readers: list[asyncio.Task[None]] = []

    async def start(self, stdin: int | object = asyncio.subprocess.DEVNULL) -> None:
        self.started = self.last_progress = time.monotonic()
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=stdin,  # type: ignore[arg-type]
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        Child.running.add(self)
        self._readers = [
            asyncio.create_task(self._read_stdout()),
            asyncio.create_task(self._read_stderr()),
        ]

    async def _read_stdout(self) -> None:
        assert self.proc is not None
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            now = time.monotonic()
            self.last_progress = now
            if line.startswith(b" [x] Done"):
                self.done += 1
                self.last_done = now
                if self.done in self.rss_at:
                    with contextlib.suppress(OSError, KeyError):
                        self.rss_samples.append((self.done, *rss_kib(self.proc.pid)))
                if self.on_done is not None:
                    self.on_done()
            elif line.startswith(b" [x] Received"):
                self.received += 1
                if self.first_received is None:
                    self.first_received = now
                    self.mark_cpu()
            else:
                if line.startswith(b" [*] Waiting") and self.ready_at is None:
                    self.ready_at = now
                self.stdout.append(line)
            self._changed.set()
        self._changed.set()

    async def _read_stderr(self) -> None:
        assert self.proc is not None
        assert self.proc.stderr is not None
        self.stderr = await self.proc.stderr.read()

    def mark_cpu(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(OSError, IndexError, ValueError):
            self.cpu_marks.append((self.done, cpu_seconds(self.proc.pid)))

    def cpu_per_task(self) -> float | None:
        """CPU seconds per task between the first and the last mark."""
        if len(self.cpu_marks) < 2 or self.cpu_marks[-1][0] == self.cpu_marks[0][0]:
            return None
        (done0, cpu0), (done1, cpu1) = self.cpu_marks[0], self.cpu_marks[-1]
        return (cpu1 - cpu0) / (done1 - done0)

    def describe(self) -> str:
        tail = self.stderr.decode(errors="replace").strip().splitlines()[-3:]
        return f"{self.name} ({shlex.join(self.argv[1:])})" + (f": {' | '.join(tail)}" if tail else "")

    async def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        """Wait until condition() holds; broken if the child exits first or stalls."""
        assert self.proc is not None
        while not condition():
            self._changed.clear()
            if self.proc.returncode is not None or self._readers[0].done():
                await self.proc.wait()
                raise Broken(
                    f"{self.describe()} exited (status {self.proc.returncode}) before {what} "
                    f"({self.received} received, {self.done} done)"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=1.0)
            if time.monotonic() - self.last_progress > STALL_SECONDS:
                raise Broken(
                    f"{self.describe()} made no progress for {STALL_SECONDS:.0f} s before {what} "
                    f"({self.received} received, {self.done} done)"
                )

    async def wait_ready(self) -> None:
        await self.wait_for(lambda: self.ready_at is not None, "it was ready")

    async def wait_done(self, count: int) -> None:
        await self.wait_for(lambda: self.done >= count, f"{count} tasks were done")

    async def finish(self, limit: float = 60.0) -> int:
        """Wait for a child that exits on its own; returns its exit status."""
        assert self.proc is not None
        try:
            status = await asyncio.wait_for(self.proc.wait(), limit)
        except TimeoutError:
            self.kill()
            raise Broken(f"{self.describe()} did not exit within {limit:.0f} s") from None
        await asyncio.gather(*self._readers)
        Child.running.discard(self)
        return status

    async def stop(self, signum: int = signal.SIGTERM, limit: float = 20.0) -> None:
        """Signal a worker to stop; broken unless it exits 0 in time."""
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(signum)
        status = await self.finish(limit)
        if status != 0:
            raise Broken(f"{self.describe()} exited with status {status} after {signal.Signals(signum).name}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
        Child.running.discard(self)


class Group:
    """Several workers on one queue, counted together."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.done = 0
        self.changed = asyncio.Event()

    def tick(self) -> None:
        self.done += 1
        self.changed.set()

    def add(self, name: str, argv: list[str]) -> Child:
        child = Child(name, argv, on_done=self.tick)
        self.children.append(child)
        return child

    async def wait_done(self, count: int) -> None:
        """Wait until the workers together did count tasks; broken if one exits or all stall."""
        last, seen = time.monotonic(), self.done
        while self.done < count:
            self.changed.clear()
            for child in self.children:
                assert child.proc is not None
                if child.proc.returncode is not None or child._readers[0].done():
                    await child.proc.wait()
                    raise Broken(f"{child.describe()} exited (status {child.proc.returncode}) too early")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout=1.0)
            if self.done != seen:
                last, seen = time.monotonic(), self.done
            elif time.monotonic() - last > STALL_SECONDS:
                raise Broken(f"workers stalled at {self.done} of {count} tasks")


# --------------------------------------------------------------------------
# Measurements


@dataclass
class Settings:
    url: str
    quick: bool
    ours_dir: Path
    reps: int
    # Repetitions of what is informative only (round-robin, baseline makespans).
    side_reps: int
    oneshot_reps: int
    dispatch_tasks: int
    batch_tasks: int
    dot_seconds: float
    rss_tasks: int
    rss_prefetch: int


def ours(settings: Settings, script: str) -> str:
    return str(settings.ours_dir / script)


def bench(script: str) -> str:
    return str(BENCH / script)


def rotations(items: Sequence[str], reps: int) -> list[list[str]]:
    """The contestants in a different order each repetition, so drift hits all alike."""
    return [list(items[r % len(items) :]) + list(items[: r % len(items)]) for r in range(reps)]


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def spread(values: Sequence[float], unit: str) -> str:
    if not values:
        return "-"
    return (
        f"median {fmt_value(median(values), unit)} "
        f"(min {fmt_value(min(values), unit)}, max {fmt_value(max(values), unit)}, n={len(values)})"
    )


def compare(
    figure: str,
    unit: str,
    samples: dict[str, list[float]],
    baseline: str,
    op: str,
    target: float | None,
    mine: str = "ours",
) -> Row:
    """A row of ours against a baseline measured in the same interleaved repetitions."""
    return Row(
        figure=figure,
        unit=unit,
        ours=median(samples[mine]),
        baseline_name=baseline,
        baseline=median(samples[baseline]),
        op=op,
        target=target,
        ours_samples=samples[mine],
        baseline_samples=samples[baseline],
        paired=True,
    )


async def worker_drained(broker: Broker, child: Child, queue: str, expected: int) -> None:
    """After a worker stopped: it did every task exactly once and the queue is empty."""
    left = await broker.depth(queue)
    if child.done != expected or left:
        raise Broken(
            f"{child.name}: {child.done} of {expected} tasks done, {left} left in the queue "
            f"({child.received} deliveries seen)"
        )


async def dispatch_rate(broker: Broker, s: Settings) -> list[Row]:
    """Zero-dot tasks through one worker at prefetch 1, the queue filled beforehand.

    The clock runs from the first " [x] Received" to the last " [x] Done", so
    interpreter start-up and connecting are left out: this is the steady rate.
    """
    n = s.dispatch_tasks
    workers = {
        "ours": ours(s, "tasks_worker.py"),
        "aio-pika minimal": bench("aiopika_min_consumer.py"),
        "pika tutorial": bench("pika_worker.py"),
    }
    bodies = [f"task {i}".encode() for i in range(n)]
    rates: dict[str, list[float]] = {k: [] for k in workers}
    cpu: dict[str, list[float]] = {k: [] for k in workers}
    for order in rotations(list(workers), s.reps):
        for name in order:
            queue = broker.new_queue("dispatch")
            await broker.declare(queue)
            await broker.fill(queue, bodies)
            argv = [
                PY,
                workers[name],
                "--url",
                s.url,
                "--queue",
                queue,
                "--prefetch",
                "1",
                "--dot-seconds",
                "0",
            ]
            child = Child(name, argv)
            await child.start()
            await child.wait_done(n)
            assert child.first_received is not None
            assert child.last_done is not None
            rates[name].append(n / max(child.last_done - child.first_received, 1e-9))
            child.mark_cpu()
            if (per_task := child.cpu_per_task()) is not None:
                cpu[name].append(1e6 * per_task)
            await child.stop()
            await worker_drained(broker, child, queue, n)
            await broker.delete(queue)
    for name, values in rates.items():
        log(f"  dispatch {name}: {spread(values, 'tasks/s')}; CPU per task {spread(cpu[name], 'us')}")
    figure = f"dispatch rate, 1 worker, prefetch 1, {n} zero-dot tasks"
    rows = [
        compare(figure, "tasks/s", rates, "aio-pika minimal", ">=", 0.95),
        compare(figure, "tasks/s", rates, "pika tutorial", ">=", 1.0),
    ]
    # The worker's own CPU per task (10 ms clock ticks over the whole run): what the
    # script costs, whatever the broker and the other sessions on the machine do.
    if all(len(v) == s.reps for v in cpu.values()):
        figure = "dispatch, worker CPU (user+sys) per task"
        rows += [
            compare(figure, "us", cpu, "aio-pika minimal", "<=", None),
            compare(figure, "us", cpu, "pika tutorial", "<=", None),
        ]
    return rows


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def run_producer(
    name: str, argv: list[str], stdin: object = asyncio.subprocess.DEVNULL
) -> tuple[float, float]:
    """Wall and CPU seconds of one producer process, spawn to exit; broken unless it exits 0.

    The CPU time is that of the children reaped meanwhile: exact as long as
    this is the only child running, as it is in the producer figures.
    """
    child = Child(name, argv)
    cpu = children_cpu()
    started = time.perf_counter()
    await child.start(stdin=stdin)
    status = await child.finish()
    elapsed = time.perf_counter() - started
    if status != 0 or not any(line.startswith(b" [x] Sent") for line in child.stdout):
        raise Broken(f"{child.describe()} exited with status {status} without ' [x] Sent'")
    return elapsed, children_cpu() - cpu


async def oneshot_latency(broker: Broker, s: Settings, results: dict[str, object]) -> list[Row]:
    """A fresh process that queues one task: spawn to exit."""
    producers = {
        "ours": [ours(s, "new_task.py"), "A", "task."],
        "pika + confirm": [bench("pika_new_task.py"), "--confirm", "A", "task."],
        "pika tutorial": [bench("pika_new_task.py"), "A", "task."],
        # The same task as one line on stdin: the aio-pika floor for
        # import, connect, declare, publish, confirm, close.
        "aio-pika minimal": [bench("aiopika_min_producer.py")],
    }
    if not s.quick:
        producers["ours initial"] = [ours(s, "new_task_initial.py"), "A", "task."]
    queue = broker.new_queue("oneshot")
    initial_queue = broker.new_queue("oneshot-initial")
    await broker.declare(queue)
    times: dict[str, list[float]] = {k: [] for k in producers}
    with tempfile.TemporaryFile() as one_line:
        one_line.write(b"A task.\n")
        for order in rotations(list(producers), s.oneshot_reps):
            for name in order:
                script, *extra = producers[name]
                # new_task_initial.py declares a plain (non-durable) queue: it gets its own.
                target = initial_queue if name == "ours initial" else queue
                one_line.seek(0)
                argv = [PY, script, "--url", s.url, "--queue", target, *extra]
                elapsed, _ = await run_producer(name, argv, stdin=one_line)
                times[name].append(1000 * elapsed)
    expected = sum(len(times[k]) for k in producers if k != "ours initial")
    if (got := await broker.depth(queue)) != expected:
        raise Broken(f"one-shot producers: {got} tasks in the queue, {expected} sent")
    if "ours initial" in producers and (got := await broker.depth(initial_queue)) != s.oneshot_reps:
        raise Broken(f"new_task_initial.py: {got} tasks in the queue, {s.oneshot_reps} sent")
    for q in (queue, initial_queue):
        await broker.delete(q)
    for name, values in times.items():
        log(f"  one-shot {name}: {spread(values, 'ms')}")
    results["oneshot_ours_ms"] = median(times["ours"])
    figure = "one-shot enqueue, new process, 1 task, spawn to exit"
    rows = [
        compare(figure, "ms", times, "pika + confirm", "<=", 1.0),
        compare(figure, "ms", times, "pika tutorial", "<=", None),
        compare(figure, "ms", times, "aio-pika minimal", "<=", None),
    ]
    if "ours initial" in times:
        figure = "one-shot enqueue, new_task_initial.py"
        rows.append(compare(figure, "ms", times, "pika tutorial", "<=", None, mine="ours initial"))
    return rows


async def batch_rate(broker: Broker, s: Settings, results: dict[str, object]) -> list[Row]:
    """new_task.py --stdin: persistent, confirmed, one connection; whole process, spawn to exit."""
    n = s.batch_tasks
    producers = {
        "ours": [ours(s, "new_task.py"), "--stdin"],
        "aio-pika minimal": [bench("aiopika_min_producer.py")],
        "aiormq raw": [bench("aiormq_publisher.py")],
    }
    rates: dict[str, list[float]] = {k: [] for k in producers}
    cpu: dict[str, list[float]] = {k: [] for k in producers}
    with tempfile.TemporaryFile() as lines:
        lines.write(b"".join(f"task {i} .\n".encode() for i in range(n)))
        for order in rotations(list(producers), s.reps):
            for name in order:
                script, *extra = producers[name]
                queue = broker.new_queue("batch")
                await broker.declare(queue)
                lines.seek(0)
                argv = [PY, script, "--url", s.url, "--queue", queue, *extra]
                elapsed, used = await run_producer(name, argv, stdin=lines)
                rates[name].append(n / elapsed)
                cpu[name].append(1e6 * used / n)
                if (got := await broker.depth(queue)) != n:
                    raise Broken(f"{name} batch: {got} tasks in the queue, {n} sent")
                await broker.delete(queue)
    for name, values in rates.items():
        log(f"  batch {name}: {spread(values, 'tasks/s')}; CPU per task {spread(cpu[name], 'us')}")
    figure = f"batch enqueue, --stdin, {n:,} tasks, spawn to exit"
    rows = [
        compare(figure, "tasks/s", rates, "aio-pika minimal", ">=", 1.0),
        compare(figure, "tasks/s", rates, "aiormq raw", ">=", 0.9),
    ]
    one_ms = results.get("oneshot_ours_ms")
    if isinstance(one_ms, float):
        rows.append(
            Row(
                figure=figure,
                unit="tasks/s",
                ours=median(rates["ours"]),
                baseline_name="one new_task.py process per task",
                baseline=1000 / one_ms,
                op=">=",
                target=1000.0,
                ours_samples=rates["ours"],
            )
        )
    # The producer's own CPU per task: less at the mercy of the shared broker's
    # disk than the rate, so it shows what the script itself costs.
    figure = "batch enqueue, producer CPU (user+sys) per task"
    rows += [
        compare(figure, "us", cpu, "aio-pika minimal", "<=", None),
        compare(figure, "us", cpu, "aiormq raw", "<=", None),
    ]
    return rows


def ideal_two_workers(durations: Sequence[float]) -> float:
    """The best makespan of these tasks on two workers: the most even split, by brute force."""
    total = sum(durations)
    best = total
    for picks in itertools.product((0, 1), repeat=len(durations) - 1):
        # The last task is pinned to one worker: mirrored splits are the same.
        load = sum(d for d, p in zip(durations, (*picks, 0), strict=True) if p)
        best = min(best, max(load, total - load))
    return best


def odd_even_tasks() -> list[bytes]:
    """The tutorial's unlucky case: every odd task heavy (4 dots), every even one light (1 dot)."""
    return [f"Task {i} {'....' if i % 2 else '.'}".encode() for i in range(1, 13)]


async def makespan_runs(
    broker: Broker,
    s: Settings,
    figure: str,
    workers: list[tuple[str, list[str]]],
    bodies: list[bytes],
    reps: int,
) -> list[float]:
    """Start the workers once; per repetition publish the tasks and time until the last is done."""
    queue = broker.new_queue(figure)
    await broker.declare(queue)
    group = Group()
    children = [
        group.add(name, [PY, argv[0], "--url", s.url, "--queue", queue, *argv[1:]]) for name, argv in workers
    ]
    spans = []
    try:
        for child in children:
            await child.start()
        for child in children:
            await child.wait_ready()
        for rep in range(reps):
            started = time.monotonic()
            await broker.fill(queue, bodies)
            await group.wait_done(len(bodies) * (rep + 1))
            spans.append(max(c.last_done or 0.0 for c in children) - started)
        for child in children:
            await child.stop()
    finally:
        for child in children:
            child.kill()
    if group.done != len(bodies) * reps or (left := await broker.depth(queue)):
        raise Broken(f"{figure}: {group.done} of {len(bodies) * reps} tasks done, {left} left")
    await broker.delete(queue)
    return spans


async def fair_dispatch(broker: Broker, s: Settings) -> list[Row]:
    """Two workers, 12 tasks, every odd one four times the work of an even one."""
    bodies = odd_even_tasks()
    d = s.dot_seconds
    ideal = ideal_two_workers([body.count(b".") * d for body in bodies])
    worker = [ours(s, "tasks_worker.py"), "--prefetch", "1", "--dot-seconds", str(d)]
    spans = await makespan_runs(
        broker, s, "oddeven", [("ours A", worker), ("ours B", worker)], bodies, s.reps
    )
    # Round-robin: the tutorial's worker before basic.qos, one task at a time and
    # no prefetch limit. (tasks_worker.py --prefetch 0 would run them all at once.)
    rr_worker = [bench("pika_worker.py"), "--prefetch", "0", "--dot-seconds", str(d)]
    rr = await makespan_runs(
        broker, s, "oddeven-rr", [("pika A", rr_worker), ("pika B", rr_worker)], bodies, s.side_reps
    )
    log(
        f"  odd/even ours prefetch 1: {spread(spans, 's')}; "
        f"round-robin {spread(rr, 's')}; ideal {ideal:.2f} s"
    )
    figure = f"makespan, 12 tasks odd heavy (4 dots) even light (1), 2 workers, prefetch 1, {d:g} s/dot"
    return [
        Row(
            figure=figure,
            unit="s",
            ours=median(spans),
            baseline_name="best schedule (computed)",
            baseline=ideal,
            op="<=",
            target=1.1,
            ours_samples=spans,
        ),
        Row(
            figure=figure,
            unit="s",
            ours=median(spans),
            baseline_name="round-robin (pika, no prefetch limit)",
            baseline=median(rr),
            op="<=",
            target=None,
            ours_samples=spans,
            baseline_samples=rr,
        ),
    ]


async def prefetch_concurrency(broker: Broker, s: Settings) -> list[Row]:
    """One worker at --prefetch 10 runs 100 one-dot tasks ten at a time."""
    d = s.dot_seconds
    bodies = [f"Task {i} .".encode() for i in range(100)]
    ideal = 100 * d / 10
    worker = [ours(s, "tasks_worker.py"), "--prefetch", "10", "--dot-seconds", str(d)]
    spans = await makespan_runs(broker, s, "prefetch10", [("ours", worker)], bodies, s.reps)
    minimal = [bench("aiopika_min_consumer.py"), "--prefetch", "10", "--dot-seconds", str(d)]
    base = await makespan_runs(
        broker, s, "prefetch10-min", [("aio-pika minimal", minimal)], bodies, s.side_reps
    )
    log(f"  prefetch 10 ours: {spread(spans, 's')}; minimal {spread(base, 's')}; ideal {ideal:.2f} s")
    figure = f"makespan, 100 one-dot tasks, 1 worker, prefetch 10, {d:g} s/dot"
    return [
        Row(
            figure=figure,
            unit="s",
            ours=median(spans),
            baseline_name="ideal (10 dot-seconds)",
            baseline=ideal,
            op="<=",
            target=1.1,
            ours_samples=spans,
        ),
        Row(
            figure=figure,
            unit="s",
            ours=median(spans),
            baseline_name="aio-pika minimal",
            baseline=median(base),
            op="<=",
            target=None,
            ours_samples=spans,
            baseline_samples=base,
        ),
    ]


async def rss_run(broker: Broker, s: Settings, name: str, script: str) -> list[tuple[int, int, int]]:
    """(tasks done, VmRSS KiB, VmHWM KiB) of one worker at 20 checkpoints through its tasks."""
    n = s.rss_tasks
    queue = broker.new_queue("rss")
    await broker.declare(queue)
    argv = [
        PY,
        script,
        "--url",
        s.url,
        "--queue",
        queue,
        "--prefetch",
        str(s.rss_prefetch),
        "--dot-seconds",
        "0",
    ]
    child = Child(name, argv)
    child.rss_at = {max(1, n * k // 20) for k in range(1, 21)}
    await child.start()
    await child.wait_ready()
    # Published while the worker consumes, in chunks: the broker's queue stays short.
    chunk = 5000
    for first in range(0, n, chunk):
        await broker.fill(queue, [f"task {i}".encode() for i in range(first, min(n, first + chunk))])
    await child.wait_done(n)
    await asyncio.sleep(0.2)
    assert child.proc is not None
    child.rss_samples.append((n, *rss_kib(child.proc.pid)))
    await child.stop()
    await worker_drained(broker, child, queue, n)
    await broker.delete(queue)
    shown = ", ".join(f"{done:,}: {rss / 1024:.1f}" for done, rss, _ in child.rss_samples[1::4])
    log(f"  RSS {name} (MiB after N tasks): {shown}; VmHWM {child.rss_samples[-1][2] / 1024:.1f}")
    return child.rss_samples


async def memory(broker: Broker, s: Settings) -> list[Row]:
    """Worker memory while it works through many zero-dot tasks: flat, not growing with the count."""
    n = s.rss_tasks
    mine = await rss_run(broker, s, "ours", ours(s, "tasks_worker.py"))
    # "Flat": the resident set at the end against the one after the first tenth of the tasks.
    early = next(rss for done, rss, _ in mine if done >= n // 10)
    rows = [
        Row(
            figure=f"worker RSS after {n:,} tasks (prefetch {s.rss_prefetch})",
            unit="MiB",
            ours=mine[-1][1] / 1024,
            baseline_name=f"same worker after {n // 10:,}",
            baseline=early / 1024,
            op="<=",
            target=1.05,
        ),
    ]
    if not s.quick:
        base = await rss_run(broker, s, "aio-pika minimal", bench("aiopika_min_consumer.py"))
        rows.append(
            Row(
                figure=f"worker peak RSS (VmHWM) after {n:,} tasks",
                unit="MiB",
                ours=mine[-1][2] / 1024,
                baseline_name="aio-pika minimal",
                baseline=base[-1][2] / 1024,
                op="<=",
                target=None,
            )
        )
    return rows


FIGURES: dict[str, Callable[..., Awaitable[list[Row]]]] = {
    "dispatch": dispatch_rate,
    "oneshot": oneshot_latency,
    "batch": batch_rate,
    "fair": fair_dispatch,
    "prefetch": prefetch_concurrency,
    "memory": memory,
}
NEEDS_RESULTS = {"oneshot", "batch"}


async def run(args: argparse.Namespace, settings: Settings) -> tuple[list[Row], list[str], list[str], str]:
    broker = Broker(settings.url)
    try:
        await broker.open()
    except Exception as error:
        raise Broken(f"cannot reach the broker at {settings.url}: {error}") from None
    # Ctrl+C or SIGTERM cancel the measuring alone: the harness's AMQP connection
    # stays up to delete the queues on the way out, and the children are stopped.
    loop = asyncio.get_running_loop()
    this = asyncio.current_task()
    assert this is not None
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, this.cancel)
    rows: list[Row] = []
    problems: list[str] = []
    retried: list[str] = []
    results: dict[str, object] = {}
    try:
        for name in args.only or list(FIGURES):
            started = time.monotonic()
            log(f"{name} ...")
            for attempt in (1, 2):
                try:
                    if name in NEEDS_RESULTS:
                        rows += await FIGURES[name](broker, settings, results)
                    else:
                        rows += await FIGURES[name](broker, settings)
                    break
                except Exception as error:
                    text = str(error) if isinstance(error, Broken) else f"{type(error).__name__}: {error}"
                    log(f"  BROKEN (attempt {attempt}): {text}")
                    if attempt == 1:
                        # The broker is shared: another session's test may have cut our
                        # connections. A figure broken twice in a row is a real problem.
                        retried.append(f"{name}: {text}")
                    else:
                        problems.append(f"{name}: {text}")
                finally:
                    for child in list(Child.running):
                        child.kill()
            log(f"  ({time.monotonic() - started:.1f} s)")
    finally:
        for child in list(Child.running):
            child.kill()
        async with asyncio.timeout(15):
            await broker.close()
    return rows, problems, retried, broker.version


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--url",
        default=os.environ.get("AMQP_URL", DEFAULT_URL),
        help="broker to measure against (default: $AMQP_URL, else %(default)s)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and tasks: under a minute")
    style = parser.add_mutually_exclusive_group()
    style.add_argument(
        "--rst",
        action="store_const",
        dest="style",
        const="rst",
        help="print a reStructuredText 'Performance' section for the README",
    )
    style.add_argument(
        "--markdown", action="store_const", dest="style", const="markdown", help="print the table as Markdown"
    )
    parser.add_argument(
        "--only", action="append", choices=list(FIGURES), help="measure only this figure (repeatable)"
    )
    parser.add_argument(
        "--ours-dir",
        type=Path,
        default=ROOT,
        help="where new_task.py, new_task_initial.py and tasks_worker.py are (default: the repository root)",
    )
    parser.add_argument("--json", type=Path, help="also write the run, every sample included, to this file")
    parser.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="measure nothing: print the run saved in this --json file (with --rst or --markdown)",
    )
    parser.add_argument("--reps", type=int, help="repetitions per figure (default: 3 quick, 7 full)")
    return parser.parse_args(argv)


def render_record(record: dict[str, Any], style: str) -> str:
    fields = {f.name for f in dataclasses.fields(Row)}
    rows = [Row(**{k: v for k, v in row.items() if k in fields}) for row in record["rows"]]
    return report(rows, style, record["command"], record["machine"], record["date"], record["wall_seconds"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        # Only print a run saved earlier with --json, in the style asked for.
        print(render_record(json.loads(args.render.read_text()), args.style or "text"))
        return 0
    quick = args.quick
    settings = Settings(
        url=args.url,
        quick=quick,
        ours_dir=args.ours_dir.resolve(),
        reps=args.reps or (3 if quick else 7),
        side_reps=1 if quick else (args.reps or 5),
        oneshot_reps=(args.reps or 0) * 2 or (5 if quick else 15),
        dispatch_tasks=1500 if quick else 5000,
        batch_tasks=3000 if quick else 20000,
        dot_seconds=0.1,
        rss_tasks=10_000 if quick else 100_000,
        rss_prefetch=10,
    )
    missing = [
        name
        for name in ("new_task.py", "new_task_initial.py", "tasks_worker.py")
        if not (settings.ours_dir / name).is_file()
    ]
    if missing:
        print(f"error: not found in {settings.ours_dir}: {', '.join(missing)}", file=sys.stderr)
        return 1
    started = time.monotonic()
    try:
        rows, problems, retried, version = asyncio.run(run(args, settings))
    except Broken as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: children stopped, queues deleted", file=sys.stderr)
        return 130
    wall = time.monotonic() - started
    # The command as given, less the address of a broker other than the default.
    shown = ["python", "bench/run.py"] + (["--quick"] if quick else [])
    shown += [arg for name in args.only or [] for arg in ("--only", name)]
    shown += ["--reps", str(args.reps)] if args.reps else []
    shown += ["--url", "URL"] if args.url != DEFAULT_URL else []
    record = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_summary(version, args.url),
        "command": shlex.join(shown),
        "wall_seconds": wall,
        "settings": {**asdict(settings), "ours_dir": str(settings.ours_dir)},
        "rows": [{**asdict(r), "ratio": r.ratio, "met": r.met} for r in rows],
        "problems": problems,
        "retried": retried,
    }
    print(render_record(record, args.style or "text"))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2))
    missed = [f"{r.figure} vs {r.baseline_name}" for r in rows if r.met is False]
    for text in missed:
        print(f"target missed: {text}", file=sys.stderr)
    for text in retried:
        print(f"retried once after: {text}", file=sys.stderr)
    for text in problems:
        print(f"BROKEN: {text}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
