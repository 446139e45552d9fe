"""Static checks of docker-compose.yml: no Docker engine or broker is needed."""

import re
from pathlib import Path

import pytest
import yaml

COMPOSE_FILE = Path(__file__).resolve().parent.parent / "docker-compose.yml"
DATA_DIR = "/var/lib/rabbitmq"
CONF_D = "/etc/rabbitmq/conf.d/"
PERMIT_LINE = "deprecated_features.permit.transient_nonexcl_queues = true"


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def service(compose):
    (only,) = compose["services"].values()
    return only


def image_tag(service):
    image = service["image"]
    name, _, tag = image.rpartition(":")
    if "/" in tag or not name:  # "host:port/repo" without a tag
        return ""
    return tag


def published_ports(service):
    """Map container port -> host port for every published port."""
    published = {}
    for port in service.get("ports", []):
        if isinstance(port, dict):
            if port.get("published") is not None:
                published[int(port["target"])] = int(port["published"])
            continue
        parts = str(port).split("/")[0].split(":")
        if len(parts) >= 2:
            published[int(parts[-1])] = int(parts[-2])
    return published


def volume_mounts(service):
    """Map mount target -> (type, source)."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            mounts[volume["target"]] = (volume.get("type"), volume.get("source"))
            continue
        parts = volume.split(":")
        if len(parts) == 1:
            mounts[parts[0]] = ("volume", None)
        else:
            source = parts[0]
            kind = "bind" if source.startswith((".", "/", "~")) else "volume"
            mounts[parts[1]] = (kind, source)
    return mounts


def mounted_configs(compose, service):
    """Yield (target, content) for each config the service mounts."""
    for entry in service.get("configs", []):
        if isinstance(entry, str):
            entry = {"source": entry}
        source = entry["source"]
        target = entry.get("target", "/" + source)
        definition = compose["configs"][source]
        if "content" in definition:
            content = definition["content"]
        else:
            content = (COMPOSE_FILE.parent / definition["file"]).read_text()
        yield target, content


def permits_transient_queues(content):
    lines = (re.sub(r"\s*=\s*", " = ", line.strip()) for line in content.splitlines())
    return PERMIT_LINE in lines


def seconds(duration):
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_compose_defines_a_single_rabbitmq_service(compose):
    assert list(compose["services"]) == ["rabbitmq"]


def test_compose_uses_the_management_image(service):
    assert service["image"].startswith("rabbitmq:")
    assert "management" in image_tag(service)


def test_compose_pins_the_image_to_a_version(service):
    tag = image_tag(service)
    assert tag != "latest"
    assert re.match(r"\d+\.\d+(\.\d+)?-", tag), tag


def test_compose_publishes_amqp_port_5672(service):
    assert published_ports(service).get(5672) == 5672


def test_compose_publishes_management_port_15672(service):
    assert published_ports(service).get(15672) == 15672


def test_compose_keeps_durable_queues_across_recreation(service):
    # The node name, and so its data directory, follows the hostname.
    assert service.get("hostname")


def test_compose_stores_broker_data_in_a_named_volume(service):
    kind, source = volume_mounts(service).get(DATA_DIR, (None, None))
    assert kind == "volume"
    assert source


def test_compose_declares_the_data_volume_at_top_level(compose, service):
    _, source = volume_mounts(service).get(DATA_DIR, (None, None))
    assert source in (compose.get("volumes") or {})


def test_compose_healthcheck_pings_the_node(service):
    check = service["healthcheck"]["test"]
    words = check.split() if isinstance(check, str) else " ".join(check).split()
    assert "rabbitmq-diagnostics" in words
    assert "ping" in words


def test_compose_healthcheck_allows_a_minute_for_first_boot(service):
    # Docker's defaults apply to whatever the file leaves out.
    health = service["healthcheck"]
    grace = seconds(health.get("start_period", "0s"))
    retrying = seconds(health.get("interval", "30s")) * health.get("retries", 3)
    assert grace + retrying >= 60


def test_compose_healthcheck_gives_the_cli_time_to_answer(service):
    # rabbitmq-diagnostics boots an Erlang VM of its own before it pings.
    assert seconds(service["healthcheck"].get("timeout", "30s")) >= 5


def test_compose_permits_transient_nonexclusive_queues(compose, service):
    contents = [content for _, content in mounted_configs(compose, service)]
    assert any(permits_transient_queues(content) for content in contents)


def test_compose_mounts_the_permit_under_conf_d(compose, service):
    targets = [
        target for target, content in mounted_configs(compose, service) if permits_transient_queues(content)
    ]
    assert targets
    for target in targets:
        # RabbitMQ reads only *.conf files directly inside conf.d.
        assert target.startswith(CONF_D)
        assert "/" not in target[len(CONF_D) :]
        assert target.endswith(".conf")
