"""The failure policy the README documents: a task whose work raises is requeued once;
when it fails again it is parked in the durable queue "<queue>.failed", never lost and
never looping. Quorum queues reach the same end through x-delivery-limit and dead-lettering.
"""

import asyncio

from conftest import delete_queues, depth_is, drain, eventually, received


def send(run, queue: str, *tasks: str, queue_type: str = "classic"):
    """Queue the tasks with the final producer, in one run; check they were all confirmed."""
    lines = "".join(f"{task}\n" for task in tasks).encode()
    sent = run("new_task.py", "--queue", queue, "--queue-type", queue_type, "--stdin", stdin=lines)
    assert sent.returncode == 0, sent.stderr_lines
    assert sent.stdout_lines == [f" [x] Sent {len(tasks)} tasks"]


def test_failed_task_is_retried_once_then_succeeds(start_worker, run, queue_name, broker_url):
    worker = start_worker("--dot-seconds", "0.01", "--fail-once-on", "FLAKY")
    task = "FLAKY task."
    send(run, queue_name, task)

    worker.wait_for(r"^ \[x\] Done$")
    assert worker.count(received(task)) == 2
    assert worker.stderr_lines == [
        f" [!] Task {task!r} failed (TaskFailed: it contains 'FLAKY' on a first delivery); "
        "back to the queue for one more attempt"
    ]
    assert worker.count(r"^ \[x\] Done$") == 1
    assert depth_is(broker_url, queue_name, 0)
    assert depth_is(broker_url, f"{queue_name}.failed", 0)


def test_task_failing_every_time_is_parked_not_lost(start_worker, run, queue_name, broker_url):
    worker = start_worker("--dot-seconds", "0.01", "--fail-on", "BAD")
    bad, good = "BAD task.", "good task."
    send(run, queue_name, bad, good)

    worker.wait_for(r"moved to queue", stream="err")
    worker.wait_for(received(good))
    worker.wait_for(r"^ \[x\] Done$")
    assert worker.count(received(bad)) == 2
    reason = "TaskFailed: it contains 'BAD'"
    assert worker.stderr_lines == [
        f" [!] Task {bad!r} failed ({reason}); back to the queue for one more attempt",
        f" [!] Task {bad!r} failed again ({reason}); moved to queue '{queue_name}.failed'",
    ]
    # The worker went on: the good task, queued after the bad one, was done.
    assert worker.count(r"^ \[x\] Done$") == 1

    assert depth_is(broker_url, queue_name, 0)
    [parked] = asyncio.run(drain(broker_url, f"{queue_name}.failed"))
    assert parked.body == bad.encode()
    assert parked.delivery_mode == 2  # persistent: it survives a broker restart
    assert "TaskFailed" in parked.headers["x-failure"]
    assert "BAD" in parked.headers["x-failure"]


def test_quorum_queue_parks_a_poison_task_via_delivery_limit(start_worker, run, queue_name, broker_url):
    worker = start_worker("--dot-seconds", "0.01", "--queue-type", "quorum", "--fail-on", "BAD")
    bad, good = "BAD task.", "good task."
    send(run, queue_name, bad, queue_type="quorum")

    # The broker moves the task itself once its delivery limit is passed.
    eventually(lambda: depth_is(broker_url, f"{queue_name}.failed", 1), what="the task in .failed")
    # A task queued afterwards is done: had the bad one looped, it would
    # show up again before this one finishes.
    send(run, queue_name, good, queue_type="quorum")
    worker.wait_for(received(good))
    worker.wait_for(r"^ \[x\] Done$")
    assert worker.count(received(bad)) == 2
    assert worker.count(r"back to the queue for one more attempt", stream="err") == 1
    assert worker.count(r"failed again .*; RabbitMQ moves it to queue", stream="err") == 1

    assert depth_is(broker_url, queue_name, 0)
    [parked] = asyncio.run(drain(broker_url, f"{queue_name}.failed"))
    assert parked.body == bad.encode()
    assert parked.delivery_mode == 2
    # The broker's own record of why it moved the task.
    assert parked.headers["x-first-death-reason"] == "delivery_limit"
    assert parked.headers["x-first-death-queue"] == queue_name


def test_failure_policy_holds_with_prefetch(start_worker, run, queue_name, broker_url):
    worker = start_worker("--dot-seconds", "0.02", "--prefetch", "3", "--fail-on", "BAD")
    tasks = ["BAD one.", "good one..", "BAD two.", "good two.", "good three...", "BAD three.", "good four."]
    bad = [task for task in tasks if "BAD" in task]
    good = [task for task in tasks if "BAD" not in task]
    send(run, queue_name, *tasks)

    eventually(lambda: worker.count(r"^ \[x\] Done$") == len(good), what="every good task done")
    eventually(
        lambda: worker.count(r"moved to queue", stream="err") == len(bad), what="every bad task parked"
    )
    for task in good:
        assert worker.count(received(task)) == 1, task
    for task in bad:
        assert worker.count(received(task)) == 2, task
    assert depth_is(broker_url, queue_name, 0)
    parked = asyncio.run(drain(broker_url, f"{queue_name}.failed"))
    assert sorted(message.body.decode() for message in parked) == sorted(bad)


def test_task_is_parked_even_if_the_failed_queue_was_deleted(start_worker, run, queue_name, broker_url):
    # Someone deleted the parking queue while the worker ran: the copy must
    # still land somewhere durable, or the ack would lose the task.
    worker = start_worker("--dot-seconds", "0", "--fail-on", "BAD")
    asyncio.run(delete_queues(broker_url, f"{queue_name}.failed"))
    send(run, queue_name, "BAD task.")

    worker.wait_for(r"moved to queue", stream="err")
    [parked] = asyncio.run(drain(broker_url, f"{queue_name}.failed"))
    assert parked.body == b"BAD task."
    assert depth_is(broker_url, queue_name, 0)
