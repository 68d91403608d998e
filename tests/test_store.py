"""The store nobody else can reach or mislead: a local run listens on loopback only, and
keys that no rank wrote make no rank the origin of a failure or take a live one for
frozen."""

from __future__ import annotations

import ipaddress
import os
import sys
import threading
import time

import pytest
import store_cases

import pipetrain


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_local_run_listens_on_loopback_only() -> None:
    found = pipetrain.launch(store_cases.listeners_of_the_job, 2, timeout_s=60)
    addresses = {a for each in found for a in each["worker"] + each["launcher"]}
    assert found[0]["launcher"], "the launcher's store should be listening"
    assert all(each["worker"] for each in found), "each worker's gloo socket should listen"
    outside = [a for a in addresses if not ipaddress.ip_address(a).is_loopback]
    assert not outside, f"listening outside loopback: {outside} (all: {found})"


def test_a_planted_failure_record_is_no_ones_failure() -> None:
    messages = pipetrain.launch(store_cases.planted_failure_record, 2, 2, timeout_s=60)
    assert messages[1].startswith("rank 1 (stage 1) failed at F1.0: ValueError: bad shape")
    assert messages[0].startswith(
        "rank 0 (stage 0) stopped because rank 1 (stage 1) failed first: rank 1 (stage 1) "
        "failed at F1.0"
    ), messages[0]
    assert not any("coffee" in message for message in messages)


def test_a_planted_heartbeat_takes_no_live_peer_for_frozen() -> None:
    assert pipetrain.launch(store_cases.planted_heartbeat, 2, 4.0, timeout_s=60) == [7.0, 7.0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_poke_at_the_store_floods_nothing_and_breaks_nothing(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Random bytes on a thousand connections to the launcher's store during a run."""
    poked: dict[str, int] = {}

    def poke_once_listening() -> None:
        deadline = time.monotonic() + 60
        while not store_cases.listening(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.05)
        addresses = store_cases.listening_ports(os.getpid())
        poked["connections"] = sum(store_cases.poke(port, 1.0) for port in addresses)

    poker = threading.Thread(target=poke_once_listening)
    capfd.readouterr()
    poker.start()
    try:
        assert pipetrain.launch(store_cases.poked_job, 2, 3.0, timeout_s=60) == ["ok", "ok"]
    finally:
        poker.join()
    err = capfd.readouterr().err
    assert poked["connections"] > 100
    assert len(err.splitlines()) < 10, err[:2000]
