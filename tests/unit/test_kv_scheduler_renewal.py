"""The decode scheduler half renews leases of requests still in its queue, and stops once the
request is allocated (it pulls) or finished."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from kvtransfer.config import ConnectorConfig
from kvtransfer.connector.scheduler import SchedulerHalf


def _request(rid: str, lease_s: float) -> Any:
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p",
              "remote_request_id": f"remote-{rid}", "remote_block_ids": [1, 2],
              "remote_handshake": "eA==", "remote_num_tokens": 20, "lease_s": lease_s}
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, trace_headers=None,
                           prompt_token_ids=list(range(20)))


def test_renewals_while_queued_and_none_after_allocation() -> None:
    half = SchedulerHalf("engine", ConnectorConfig(lease_s=0.3))
    waiting, served = _request("a", 0.3), _request("b", 0.3)
    half.on_new_request(waiting)
    half.on_new_request(served)
    assert half.build_connector_meta().renewals == []  # not due yet (a third of the lease)
    time.sleep(0.15)
    first = half.build_connector_meta().renewals
    assert sorted(r.request_id for r in first) == ["remote-a", "remote-b"]
    assert half.build_connector_meta().renewals == []  # rescheduled, not repeated each step

    blocks = SimpleNamespace(get_unhashed_block_ids=lambda: [7, 8])
    half.update_state_after_alloc(served, blocks, 20)  # b pulls now
    time.sleep(0.15)
    meta = half.build_connector_meta()
    assert [r.request_id for r in meta.renewals] == ["remote-a"]
    assert [p.request_id for p in meta.pulls] == ["b"]
