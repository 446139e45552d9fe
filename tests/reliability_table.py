#!/usr/bin/env python
"""Regenerate the README's "Reliability" table from a real run of the fault tests.

    python tests/reliability_table.py              # runs the fault tests, then prints the table
    python tests/reliability_table.py --no-run     # only prints the table of the last run

Each fault test (tests/test_faults.py, test_soak.py, test_cluster.py) writes its
figures to tests/.figures/<test>.json through record(); this command clears that
directory, runs those tests, and prints one RST row per file.

Figures, all counted by task body from the scripts' own output:
sent       tasks the producer reported sent (" [x] Sent", confirmed by the broker
           for new_task.py), or published by the test itself
completed  distinct tasks a worker finished (" [x] Done")
lost       sent tasks never finished and no longer anywhere in the broker
duplicated tasks finished more than once (allowed by at-least-once delivery
           only for tasks in flight at the fault)
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

TESTS = Path(__file__).resolve().parent
FIGURES = TESTS / ".figures"
FAULT_TESTS = ("tests/test_faults.py", "tests/test_soak.py", "tests/test_cluster.py")
COLUMNS = ("fault", "how it is produced", "test", "sent", "completed", "lost", "duplicated")

RECEIVED = re.compile(r"^ \[x\] Received (.*)$")
DONE = " [x] Done"


class HasOutput(Protocol):
    stdout_lines: list[str]


def tally(workers: Iterable[HasOutput]) -> tuple[Counter[str], Counter[str]]:
    """(Received, Done) counts per task, keyed by the repr the worker prints.

    A worker prints " [x] Done" after the " [x] Received" line of the same task,
    so each Done counts for the last task its own process received.
    """
    received: Counter[str] = Counter()
    done: Counter[str] = Counter()
    for worker in workers:
        current = None
        for line in list(worker.stdout_lines):
            if found := RECEIVED.match(line):
                current = found[1]
                received[current] += 1
            elif line == DONE:
                assert current is not None, f"a Done line before any Received line: {worker.stdout_lines}"
                done[current] += 1
    return received, done


def record(
    test: str, *, fault: str, how: str, sent: int, completed: int, lost: int, duplicated: int
) -> dict[str, object]:
    """Write one test's figures to tests/.figures/<test>.json, and print them for `pytest -s`."""
    figures: dict[str, object] = {
        "fault": fault,
        "how it is produced": how,
        "test": test,
        "sent": sent,
        "completed": completed,
        "lost": lost,
        "duplicated": duplicated,
        "recorded_at": time.time(),
    }
    FIGURES.mkdir(exist_ok=True)
    safe = re.sub(r"[^\w.-]", "_", test)
    (FIGURES / f"{safe}.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"\nfigures {test}: sent {sent}, completed {completed}, lost {lost}, duplicated {duplicated}")
    return figures


def record_done(test: str, *, fault: str, how: str, sent: int, done: Counter[str]) -> dict[str, object]:
    """record() for a fault after which every task sent must be done, at least once."""
    return record(
        test,
        fault=fault,
        how=how,
        sent=sent,
        completed=len(done),
        lost=sent - len(done),
        duplicated=sum(1 for times in done.values() if times > 1),
    )


def rst_table(rows: list[dict[str, object]]) -> str:
    """A list-table: its rows wrap, where a simple table's long test names would not."""
    lines = [".. list-table::", "   :header-rows: 1", ""]
    for cells in [list(COLUMNS), *([str(row[column]) for column in COLUMNS] for row in rows)]:
        if cells[2] != "test":
            cells[2] = f"``{cells[2]}``"
        lines.append(f"   * - {cells[0]}")
        lines.extend(f"     - {cell}" for cell in cells[1:])
    return "\n".join(lines)


def read_figures() -> list[dict[str, object]]:
    rows = [json.loads(path.read_text()) for path in FIGURES.glob("*.json")]
    return sorted(rows, key=lambda row: float(row["recorded_at"]))  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--no-run", action="store_true", help="print the figures of the last run only")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --")
    args = parser.parse_args(argv)
    if not args.no_run:
        for old in FIGURES.glob("*.json"):
            old.unlink()
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FAULT_TESTS]
        status = subprocess.run([*command, *args.pytest_args], cwd=TESTS.parent).returncode
        if status != 0:
            print(f"the fault tests failed (exit {status}); no table", file=sys.stderr)
            return 1
    rows = read_figures()
    if not rows:
        print(f"no figures in {FIGURES}; run without --no-run", file=sys.stderr)
        return 1
    print(rst_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
