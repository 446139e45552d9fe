"""Round-robin dispatching: two workers, five tasks, the tutorial's transcript."""

import re

TASKS = ["First message.", "Second message..", "Third message...", "Fourth message....", "Fifth message....."]


def test_round_robin_transcript(start_worker, run, queue_name):
    # Idle workers take turns: with the tasks this short, fair dispatch
    # (prefetch 1, the default) hands them out exactly as round-robin does.
    c1 = start_worker("--dot-seconds", "0.01")
    c2 = start_worker("--dot-seconds", "0.01")
    for task in TASKS:
        sent = run("new_task.py", "--queue", queue_name, *task.split())
        assert sent.returncode == 0
        assert sent.stdout_lines == [f" [x] Sent {task!r}"]
    for worker, expected in ((c1, TASKS[0::2]), (c2, TASKS[1::2])):
        worker.wait_for(re.escape(f" [x] Received {expected[-1]!r}"))
    assert [line for line in c1.stdout_lines if "Received" in line] == [
        f" [x] Received {task!r}" for task in TASKS[0::2]
    ]
    assert [line for line in c2.stdout_lines if "Received" in line] == [
        f" [x] Received {task!r}" for task in TASKS[1::2]
    ]
