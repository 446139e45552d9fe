"""What goes wrong, said in one line: no broker, wrong credentials, a missing vhost, a bad URL,
the tutorial's own pitfall of redeclaring a queue with other properties, bad options.

Each error is one stderr line starting "error: ", exit code 1 (2 for bad options),
no traceback, and never the password.
"""

import re
import socket

import pytest
from conftest import WAITING_LINE

PASSWORD = "s3cr3t-pw"
SCRIPTS = ["new_task_initial.py", "new_task.py", "tasks_worker.py"]


def closed_port() -> int:
    """A loopback port nothing listens on: bind to get a free one, then let it go."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def the_error(script, returncode: int = 1) -> str:
    """Check the shape every error shares and return its one line."""
    everything = "\n".join(script.stdout_lines + script.stderr_lines)
    assert script.returncode == returncode, everything
    assert len(script.stderr_lines) == 1, script.stderr_lines
    [line] = script.stderr_lines
    assert line.startswith("error: "), line
    assert "Traceback" not in everything
    assert PASSWORD not in everything
    assert not any(" [x] Sent" in out for out in script.stdout_lines)
    return line


@pytest.mark.parametrize("name", SCRIPTS)
def test_unreachable_broker_is_named_with_how_to_start_one(run, name, queue_name):
    port = closed_port()
    script = run(name, "--url", f"amqp://guest:{PASSWORD}@127.0.0.1:{port}/", "--queue", queue_name)
    line = the_error(script)
    assert f"127.0.0.1:{port}" in line
    assert "docker compose up -d" in line


@pytest.mark.parametrize("name", SCRIPTS)
def test_wrong_credentials_name_the_user(run, name, queue_name):
    script = run(name, "--url", f"amqp://guest:{PASSWORD}@localhost:5672/", "--queue", queue_name)
    line = the_error(script)
    assert "user 'guest'" in line
    assert "wrong user name or password" in line


@pytest.mark.parametrize("name", SCRIPTS)
def test_missing_vhost_is_named_with_how_to_add_it(run, name, queue_name):
    script = run(name, "--url", "amqp://guest:guest@localhost:5672/no-such-vhost-xyz", "--queue", queue_name)
    line = the_error(script)
    assert "'no-such-vhost-xyz'" in line
    assert "rabbitmqctl add_vhost no-such-vhost-xyz" in line


MALFORMED = {
    "no-scheme": ("localhost:5672", None),
    "port-not-a-number": (
        f"amqp://guest:{PASSWORD}@localhost:notaport/",
        "amqp://guest:****@localhost:notaport/",
    ),
    "not-amqp": (f"http://guest:{PASSWORD}@x/", "http://guest:****@x/"),
    # A '/' left unencoded in the password makes the URL malformed; the
    # password must stay hidden all the same.
    "slash-in-password": ("amqp://guest:s3cr3t-pw/2@localhost:5672/", "amqp://guest:****@localhost:5672/"),
}


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize(("url", "masked"), MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_url_is_one_line_with_the_password_masked(run, name, url, masked, queue_name):
    line = the_error(run(name, "--url", url, "--queue", queue_name))
    assert "malformed broker URL" in line
    assert "amqp://user:password@host:port/vhost" in line
    if masked:
        assert masked in line
    else:
        assert url in line


def assert_explains_the_redeclaration(line: str, argument: str, queue: str) -> None:
    assert "already exists with other properties" in line
    assert argument in line
    assert "--queue" in line
    assert f"rabbitmqctl delete_queue {queue}" in line


@pytest.mark.parametrize("name", ["new_task.py", "tasks_worker.py"])
def test_durable_declaration_of_the_first_plain_queue_is_explained(run, name, queue_name):
    # The tutorial's pitfall: "hello" was declared non-durable by the first
    # producer, and RabbitMQ refuses to redeclare it durable (406).
    assert run("new_task_initial.py", "--queue", queue_name).returncode == 0
    line = the_error(run(name, "--queue", queue_name))
    assert_explains_the_redeclaration(line, "durable", queue_name)


def test_plain_declaration_of_a_durable_queue_is_explained(run, queue_name):
    assert run("new_task.py", "--queue", queue_name).returncode == 0
    line = the_error(run("new_task_initial.py", "--queue", queue_name))
    assert_explains_the_redeclaration(line, "durable", queue_name)


@pytest.mark.parametrize("name", ["new_task.py", "tasks_worker.py"])
def test_quorum_declaration_of_a_classic_queue_names_the_queue_type(run, name, queue_name):
    assert run("new_task.py", "--queue", queue_name).returncode == 0
    line = the_error(run(name, "--queue", queue_name, "--queue-type", "quorum"))
    # The broker reports the first argument that differs, which on RabbitMQ 3.10
    # is x-dead-letter-exchange, checked before x-queue-type; the line names
    # it and shows how to see the queue's type.
    assert_explains_the_redeclaration(line, "x-", queue_name)
    assert re.search(r"\((x-queue-type|x-dead-letter-exchange): ", line)
    assert "rabbitmqctl list_queues name durable type arguments" in line


BAD_OPTIONS = [
    ("tasks_worker.py", "--prefetch", "-1"),
    ("tasks_worker.py", "--prefetch", "70000"),
    ("tasks_worker.py", "--dot-seconds", "abc"),
    ("tasks_worker.py", "--grace-seconds", "-1"),
    ("tasks_worker.py", "--queue-type", "nope"),
    ("new_task.py", "--queue-type", "nope"),
    ("new_task.py", "--nope"),
    ("new_task.py", "--stdin", "Some", "words."),
    ("new_task_initial.py", "--stdin", "Some", "words."),
    ("new_task_initial.py", "--nope"),
]


@pytest.mark.parametrize("command", BAD_OPTIONS, ids=" ".join)
def test_bad_option_value_is_one_line_pointing_to_help(run, command):
    script = run(*command)
    line = the_error(script, returncode=2)
    assert "--help" in line
    assert script.stdout_lines == []
    # One line a person can read: not a listing of every allowed value.
    assert len(line) < 300, f"{len(line)} characters: {line[:120]}..."


@pytest.mark.parametrize("name", SCRIPTS)
def test_amqp_url_from_the_environment_is_used(start, script_env, name, queue_name):
    port = closed_port()
    env = {**script_env, "AMQP_URL": f"amqp://guest:{PASSWORD}@127.0.0.1:{port}/"}
    script = start(name, "--queue", queue_name, env=env)
    script.finish()
    assert f"127.0.0.1:{port}" in the_error(script)


def several_addresses(broker_url: str, form: str) -> list[str]:
    unreachable = f"amqp://guest:guest@127.0.0.1:{closed_port()}/"
    if form == "comma-separated":
        return ["--url", f"{unreachable},{broker_url}"]
    return ["--url", unreachable, "--url", broker_url]


@pytest.mark.parametrize("form", ["comma-separated", "repeated"])
@pytest.mark.parametrize("name", ["new_task_initial.py", "new_task.py"])
def test_producer_moves_on_to_the_next_address(run, broker_url, name, form, queue_name):
    script = run(name, *several_addresses(broker_url, form), "--queue", queue_name, "Over there.")
    assert script.returncode == 0, script.stderr_lines
    assert script.stdout_lines == [" [x] Sent 'Over there.'"]


@pytest.mark.parametrize("form", ["comma-separated", "repeated"])
def test_worker_moves_on_to_the_next_address(start, broker_url, form, queue_name):
    worker = start("tasks_worker.py", *several_addresses(broker_url, form), "--queue", queue_name)
    worker.wait_for(re.escape(WAITING_LINE))
