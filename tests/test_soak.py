"""Soak: 5,000 tasks through workers that keep being killed, and a broker restart halfway.

At-least-once, counted by task body from the workers' own output: every task is
finished at least once, none is lost, and a task is finished twice only if it was in
flight when its worker was killed or when the broker went down.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
import uuid
from pathlib import Path

import pytest
from conftest import WAITING_LINE, Script, eventually
from reliability_table import record, tally

pytestmark = pytest.mark.private_broker

TASKS = 5000
WORKERS = 3
PREFETCH = 1
RESTART_AT = TASKS * 2 // 5  # tasks finished when the broker is restarted
KILL_EVERY = 150  # tasks done between two kills, on average, if that comes before a second
CHAOS_SECONDS = 60  # the whole run must finish within this, after the tasks are queued


def chaos_schedule(chance: random.Random, done: int) -> tuple[float, int]:
    """When to kill the next worker: after about a second, or sooner if ~KILL_EVERY tasks got done."""
    return time.monotonic() + chance.uniform(0.5, 1.5), done + chance.randint(
        KILL_EVERY // 2, KILL_EVERY * 3 // 2
    )


def last_received(worker: Script) -> str:
    """The task a worker (at prefetch 1) holds or last held, as it prints it."""
    lines = [line for line in worker.stdout_lines if line.startswith(" [x] Received ")]
    return lines[-1].removeprefix(" [x] Received ") if lines else ""


def wait_quiet(workers: list[Script], quiet: float = 0.3, timeout: float = 5) -> None:
    """Wait until none of the workers has printed anything for `quiet` seconds."""
    deadline = time.monotonic() + timeout
    before = [len(worker.stdout_lines) for worker in workers]
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = [len(worker.stdout_lines) for worker in workers]
        if now == before:
            return
        before = now
    raise AssertionError(f"workers still printing after {timeout} s with the broker down")


def save_transcripts(
    directory: Path, workers: list[Script], killed: list[Script], at_restart: list[Script]
) -> Path:
    """Every worker's output, to read when a figure looks wrong."""
    for number, worker in enumerate(workers, 1):
        fate = "killed" if worker in killed else "alive"
        restart = ", up during the restart" if worker in at_restart else ""
        (directory / f"worker-{number:02d}.log").write_text(
            f"# {fate}{restart}\n# stdout\n"
            + "\n".join(worker.stdout_lines)
            + "\n# stderr\n"
            + "\n".join(worker.stderr_lines)
            + "\n"
        )
    return directory


@pytest.mark.timeout(75)
def test_soak_at_least_once_under_kills_and_a_broker_restart(node, start, script_env, request, tmp_path):
    env = {**script_env, "AMQP_URL": node.url}
    queue = f"wq-soak-{uuid.uuid4().hex[:10]}"
    bodies = [f"task-{n:05d}" for n in range(1, TASKS + 1)]
    everything = {repr(body) for body in bodies}
    seed = int(os.environ.get("SOAK_SEED", random.randrange(1 << 32)))
    chance = random.Random(seed)
    print(f"\nsoak: seed {seed} (rerun with SOAK_SEED={seed})")

    sent = start("new_task.py", "--queue", queue, "--stdin", env=env, stdin="\n".join(bodies).encode())
    assert sent.finish(timeout=60) == 0
    assert sent.stdout_lines == [f" [x] Sent {TASKS} tasks"]

    def new_worker() -> Script:
        return start(
            "tasks_worker.py", "--queue", queue, "--dot-seconds", "0", "--prefetch", str(PREFETCH), env=env
        )

    everyone = [new_worker() for _ in range(WORKERS)]
    alive = list(everyone)
    killed: list[Script] = []
    at_restart: list[Script] = []
    in_flight: set[str] = set()  # each worker's last task when it was killed or the broker stopped
    remaining_at_restart = 0
    started = time.monotonic()
    kill_at, kill_after = chaos_schedule(chance, 0)
    while True:
        done = tally(everyone)[1]
        if done.keys() >= everything or time.monotonic() - started > CHAOS_SECONDS:
            break
        if not at_restart and len(done) >= RESTART_AT:
            at_restart = list(alive)
            for worker in at_restart:  # none still connecting when the broker goes away
                worker.wait_for(re.escape(WAITING_LINE))
            # `rabbitmqctl stop` takes a second to start, in which the workers
            # would finish the rest: frozen, they hold their tasks until the
            # broker is down, then live through the outage.
            for worker in at_restart:
                worker.signal(signal.SIGSTOP)
            try:
                node.stop()
            finally:
                for worker in at_restart:
                    worker.signal(signal.SIGCONT)
            # Thawed, a worker may still print a task the broker had sent it
            # before going down: its last task before the broker is back.
            for worker in at_restart:
                worker.wait_for(rf"^ \[!\] Lost the connection to 127\.0\.0\.1:{node.port} ", stream="err")
            wait_quiet(at_restart)
            in_flight.update(last_received(worker) for worker in at_restart)
            remaining_at_restart = TASKS - len(tally(everyone)[1])
            print(f"soak: broker stopped with {remaining_at_restart} tasks not done yet; starting it again")
            node.start()
            kill_at, kill_after = chaos_schedule(chance, len(done))
        elif (time.monotonic() >= kill_at or len(done) >= kill_after) and (
            consuming := [worker for worker in alive if worker.stdout_lines[:1] == [WAITING_LINE]]
        ):
            victim = chance.choice(consuming)
            alive.remove(victim)
            victim.process.kill()
            assert victim.finish() == -signal.SIGKILL
            killed.append(victim)
            in_flight.add(last_received(victim))
            replacement = new_worker()  # not waited for: the others go on meanwhile
            alive.append(replacement)
            everyone.append(replacement)
            kill_at, kill_after = chaos_schedule(chance, len(done))
        time.sleep(0.02)
    elapsed = time.monotonic() - started
    transcripts = save_transcripts(tmp_path, everyone, killed, at_restart)

    received, done = tally(everyone)
    missing = everything - done.keys()
    duplicated = sorted(body for body, times in done.items() if times > 1)
    left = node.queue_messages(queue)
    print(
        f"soak: {TASKS} sent, {len(done)} completed, {len(missing)} missing, "
        f"{len(duplicated)} completed twice or more, {len(killed)} workers killed, 1 broker restart, "
        f"{elapsed:.1f} s"
    )
    if duplicated:
        print(f"soak: completed more than once: {', '.join(duplicated)}")
    print(f"soak: the workers' output is in {transcripts}")
    record(
        request.node.name,
        fault="soak: workers killed, broker restarted",
        how=f"{TASKS} tasks, {WORKERS} workers, {len(killed)} kill -9 of a worker, one broker restart",
        sent=TASKS,
        completed=len(done),
        lost=max(0, len(missing) - (left or 0)),  # not done, and not in the queue either
        duplicated=len(duplicated),
    )

    assert not missing, f"{len(missing)} tasks never done, {left} still queued: {sorted(missing)[:20]}"
    assert done.keys() == everything  # no task done that was never sent
    assert received.keys() == everything
    eventually(lambda: node.queue_messages(queue) == 0, what="the queue empty", timeout=20)
    assert at_restart, "the broker restart never happened"
    assert remaining_at_restart > 0, "the broker stopped after the work was over"
    assert killed, "no worker was killed"
    # At-least-once: only a task in flight when its worker died or the broker
    # went down may be finished twice.
    assert set(duplicated) <= in_flight, sorted(set(duplicated) - in_flight)
    for worker in at_restart:
        if worker not in killed:
            worker.wait_for(rf"^ \[!\] Lost the connection to 127\.0\.0\.1:{node.port} ", stream="err")
            worker.wait_for(rf"^ \[\*\] Reconnected to 127\.0\.0\.1:{node.port}$", stream="err")
    for worker in alive:
        assert worker.process.poll() is None, worker.stderr_lines
    for worker in everyone:
        assert not [line for line in worker.stderr_lines if "Traceback" in line], worker.stderr_lines
