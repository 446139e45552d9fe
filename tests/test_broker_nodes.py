"""Quick checks of the private-broker harness in broker_nodes.py.

The fault tests (test_faults, test_soak, test_cluster) exercise its start, stop,
kill, restart and cluster paths; these cover what they cannot: the guard around the
shared broker, and a failed start.
"""

from __future__ import annotations

import pytest
from broker_nodes import BrokerError, BrokerNode

pytestmark = pytest.mark.private_broker


def test_refuses_shared_node_name() -> None:
    with pytest.raises(ValueError, match="shared broker"):
        BrokerNode("rabbit@localhost")
    with pytest.raises(ValueError, match="shared broker"):
        BrokerNode("rabbit")


@pytest.mark.timeout(120)
def test_start_failure_reports_log_tail() -> None:
    node = BrokerNode(extra_config="this is = not valid rabbitmq.conf\n", start_timeout=60)
    try:
        with pytest.raises(BrokerError) as info:
            node.start()
        assert node.name in str(info.value)
        assert "---" in str(info.value)  # log tails are included
        assert not node.running
    finally:
        node.cleanup()
