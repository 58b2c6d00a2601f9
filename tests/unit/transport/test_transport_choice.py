"""Every transport the project installs loads here, and `auto` says which one it chose and why.

NIXL and ucxx are dependencies CI installs: when one fails to load, the transport tests would quietly
run on fewer backends; this fails instead, with the loader's reason.
"""

from __future__ import annotations

import logging

import pytest

from shared.transport.factory import TRANSPORT_KINDS, available_transports, resolve_kind, unavailable_reason


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_every_installed_transport_loads(kind: str) -> None:
    assert unavailable_reason(kind) is None, f"{kind} does not load: {unavailable_reason(kind)}"


def test_auto_picks_the_first_that_loads_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="shared.transport.factory"):
        chosen = resolve_kind("auto")
    assert chosen == available_transports()[0] == "nixl"
    assert "transport auto: nixl (preference nixl > ucxx > tcp)" in caplog.text
