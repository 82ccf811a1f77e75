"""A JetStream subscriber refuses a bad configuration when it is built, before it connects."""

from __future__ import annotations

import math

import pytest

from event_plane.errors import ConfigError
from event_plane.nats_transport import JetStreamSubscriber


@pytest.mark.parametrize("wait", [0, -1.0, math.nan])
def test_a_pull_wait_that_is_not_positive_is_refused(wait: float) -> None:
    with pytest.raises(ConfigError, match="pull_wait_s"):
        JetStreamSubscriber("nats://127.0.0.1:1", "ns", pull_wait_s=wait)


@pytest.mark.parametrize("durable", ["", "a.b", "a b", "a*"])
def test_a_durable_name_nats_cannot_take_is_refused(durable: str) -> None:
    with pytest.raises(ConfigError, match="durable name"):
        JetStreamSubscriber("nats://127.0.0.1:1", "ns", durable=durable)
