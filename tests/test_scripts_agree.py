"""The scripts are separate files a reader can copy one by one, so they repeat a few
helpers. These tests hold the copies to each other: where two scripts must agree
with each other (and with RabbitMQ's rules), a drift fails here first."""

import importlib

import pytest

new_task = importlib.import_module("new_task")
new_task_initial = importlib.import_module("new_task_initial")
tasks_worker = importlib.import_module("tasks_worker")


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_producer_and_worker_declare_the_queue_identically(queue_type):
    # RabbitMQ refuses a redeclaration with other arguments (406), so the
    # producer's and the worker's declarations must match to the letter.
    assert new_task.queue_arguments("jobs", queue_type) == tasks_worker.queue_arguments("jobs", queue_type)


def test_quorum_queue_parks_failures_where_the_worker_does():
    arguments = tasks_worker.queue_arguments("jobs", "quorum")
    assert arguments["x-dead-letter-exchange"] == ""
    assert arguments["x-dead-letter-routing-key"] == "jobs.failed"
    assert arguments["x-delivery-limit"] == tasks_worker.QUORUM_DELIVERY_LIMIT == 1


@pytest.mark.parametrize(
    "body",
    [b"First message.", b"", b"\xff\xfe not utf-8", "caf\u00e9 \u2615".encode(), b"x" * 5000],
    ids=["text", "empty", "not-utf-8", "non-ascii", "long"],
)
def test_every_script_shows_a_task_the_same_way(body):
    shown = {module.shown(body) for module in (new_task, new_task_initial, tasks_worker)}
    assert len(shown) == 1


def test_a_long_task_is_shown_shortened_with_its_size():
    assert tasks_worker.shown(b"x" * 5000) == repr("x" * 5000)[:200] + "... (5000 bytes)"


@pytest.mark.parametrize(
    "url",
    ["amqp://guest:s3cr3t@localhost:notaport/", "amqp://guest:s3/cr3t@localhost/", "http://guest:s3cr3t@x/"],
)
def test_every_script_rejects_a_malformed_url_the_same_way(url):
    messages = set()
    for module in (new_task, new_task_initial, tasks_worker):
        with pytest.raises(module.UserError) as error:
            module.broker_addresses([url])
        messages.add(str(error.value))
    assert len(messages) == 1
    assert "s3" not in messages.pop()
