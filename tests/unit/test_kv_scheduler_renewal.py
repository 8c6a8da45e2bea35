"""The decode scheduler half renews leases of requests still in its queue, and stops once the
request is allocated (it pulls) or finished; what it does with params it may not use."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvtransfer.config import ConnectorConfig
from kvtransfer.connector.scheduler import SchedulerHalf
from kvtransfer.signing import Keyring


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


def test_params_that_are_not_an_object_are_dropped_not_crashing_the_engine() -> None:
    """Review finding 7: vLLM copies ``vllm_xargs.kv_transfer_params`` (a string or a list is
    allowed there) into the request; the connector and vLLM's own scheduler call ``.get`` on
    it. The connector turns it into None (the request runs plain) and counts a refusal."""
    half = SchedulerHalf("engine", ConnectorConfig(lease_s=1.0))
    for bad in ("x", ["do_remote_prefill"], 5):
        request = SimpleNamespace(request_id="r", kv_transfer_params=bad, trace_headers=None,
                                  prompt_token_ids=[1, 2])
        half.on_new_request(request)
        assert request.kv_transfer_params is None
        assert half.get_num_new_matched_tokens(request, 0) == (0, False)
    assert half.stats.data["refused_params"] == 3
    control = _request("ok", 1.0)  # a real dict is kept
    half.on_new_request(control)
    assert control.kv_transfer_params["do_remote_prefill"] is True


def test_vllms_cleanup_copy_of_admitted_params_is_not_counted_as_refused(tmp_path: Path) -> None:
    """When the router drops a non-streamed decode that vLLM already admitted, vLLM's API server
    submits the same signed params again as a pre-aborted request (``abort_immediately``) so the
    connector can free what it pinned. The copy is stripped (one use per signature) but is not
    a refusal: counting it made ``pdserve_kv_refused_params_total`` rise on client hang-ups
    (the across-hosts CI failure). Control: the same replay without the flag is counted."""
    keys = tmp_path / "keyring"
    keys.write_text("s3cret-0123456789abcdef-0123456789\n")
    half = SchedulerHalf("engine-d", ConnectorConfig(lease_s=30.0, signing_keys_file=str(keys)))
    blob = Keyring.parse(keys.read_text()).sign(_request("x", 30.0).kv_transfer_params,
                                                time.time(), target="engine-d")

    def arrival(rid: str, **flags: bool) -> Any:
        return SimpleNamespace(request_id=rid, kv_transfer_params=dict(blob), trace_headers=None,
                               prompt_token_ids=list(range(20)), **flags)

    admitted = arrival("cmpl-1")
    half.on_new_request(admitted)
    assert admitted.kv_transfer_params["do_remote_prefill"] is True  # first use: it pulls
    cleanup = arrival("1", abort_immediately=True)
    half.on_new_request(cleanup)
    assert cleanup.kv_transfer_params["do_remote_prefill"] is False  # stripped all the same
    assert half.stats.data["refused_params"] == 0
    replay = arrival("cmpl-2")  # control: a replay from anyone else is refused and counted
    half.on_new_request(replay)
    assert replay.kv_transfer_params["do_remote_prefill"] is False
    assert half.stats.data["refused_params"] == 1
