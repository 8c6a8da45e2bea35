"""The Grafana dashboard shows desired vs actual replicas per pool from metrics the autoscaler
really exports (a renamed metric would leave a panel silently empty)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from router.autoscale.actuators import RedisActuator
from router.autoscale.service import Autoscaler, AutoscalerSettings

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/dashboards/pdserve.json"


def exported_names() -> set[str]:
    # no connection is made: the Redis clients connect on first use
    url = "redis://127.0.0.1:9/0"
    scaler = Autoscaler(AutoscalerSettings(redis_url=url, router_url="http://127.0.0.1:9"),
                        RedisActuator(url))
    names = set()
    for family in scaler.metrics.collect():  # labelled families have no sample before use
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def test_each_pool_has_a_desired_vs_actual_panel_with_slo_attainment() -> None:
    dash = json.loads(DASHBOARD.read_text())
    for pool in ("prefill", "decode"):
        (panel,) = [p for p in dash["panels"]
                    if p["title"] == f"Autoscaler: {pool} replicas, desired vs actual"]
        exprs = [t["expr"] for t in panel["targets"]]
        assert f'pdserve_autoscaler_desired_replicas{{pool="{pool}"}}' in exprs
        assert f'pdserve_autoscaler_ready_replicas{{pool="{pool}"}}' in exprs
        assert any("pdserve_router_ttft_seconds_bucket{le=\"$ttft_slo\"}" in e for e in exprs)
    slo = {v["name"]: v for v in dash["templating"]["list"]}["ttft_slo"]
    # every choice is a bucket boundary of the router's TTFT histogram (as Prometheus prints it)
    assert {o["value"] for o in slo["options"]} <= {"0.5", "1.0", "2.5", "5.0"}


def test_dashboard_autoscaler_metrics_are_exported() -> None:
    text = DASHBOARD.read_text()
    used = set(re.findall(r"pdserve_autoscaler_[a-z_]+", text))
    exported = exported_names()
    assert used and used <= exported, f"not exported: {sorted(used - exported)}"
    # negative control: the check sees a name the autoscaler does not export
    assert "pdserve_autoscaler_wanted_replicas" not in exported
