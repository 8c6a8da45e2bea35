"""The compose actuator's pure planning: which replicas to create or remove, and the clone."""

from __future__ import annotations

from typing import Any

import pytest

from router.autoscale import compose_plan as cp


def inspection(number: int, *, project: str = "proj", service: str = "decode",
               running: bool = True, oneoff: str = "False", sep: str = "_") -> dict[str, Any]:
    """A ``docker inspect`` of a compose replica (the fields the planner reads)."""
    return {"Id": f"id{service}{number}", "Name": f"/{project}{sep}{service}{sep}{number}",
            "State": {"Running": running},
            "Config": {"Labels": {cp.PROJECT: project, cp.SERVICE: service,
                                  cp.NUMBER: str(number), cp.ONEOFF: oneoff}}}


def replicas(*numbers: int, stopped: tuple[int, ...] = (), sep: str = "_") -> list[cp.Replica]:
    found = [inspection(n, running=n not in stopped, sep=sep) for n in numbers]
    return cp.replicas_from(found, "proj", "decode")


def test_replicas_are_the_service_s_numbered_non_oneoff_containers() -> None:
    found = [inspection(2), inspection(1), inspection(1, service="prefill"),
             inspection(1, project="other"), inspection(7, oneoff="True"),
             {"Id": "x", "Config": {"Labels": {}}}]
    got = cp.replicas_from(found, "proj", "decode")
    assert [(r.number, r.name) for r in got] == [(1, "proj_decode_1"), (2, "proj_decode_2")]


def test_scale_up_adds_the_next_numbers_with_compose_names() -> None:
    plan = cp.plan_scale("proj", "decode", replicas(1), 3)
    assert plan.create == [(2, "proj_decode_2"), (3, "proj_decode_3")] and plan.remove == []
    # Compose v2 names (dashes) are kept in the same style.
    plan = cp.plan_scale("proj", "decode", replicas(1, sep="-"), 2)
    assert plan.create == [(2, "proj-decode-2")]


def test_scale_up_skips_numbers_of_stopped_replicas() -> None:
    # replica 2 is stopped: its name is taken, the new one is 3
    plan = cp.plan_scale("proj", "decode", replicas(1, 2, stopped=(2,)), 2)
    assert plan.create == [(3, "proj_decode_3")]


def test_scale_down_removes_the_highest_running_numbers() -> None:
    plan = cp.plan_scale("proj", "decode", replicas(1, 2, 3, 4, stopped=(4,)), 1)
    assert [r.number for r in plan.remove] == [3, 2] and plan.create == []


def test_never_below_one_replica() -> None:
    assert cp.plan_scale("proj", "decode", replicas(1), 0) == cp.ScalePlan()
    assert [r.number for r in cp.plan_scale("proj", "decode", replicas(1, 2), 0).remove] == [2]


def test_steady_is_a_no_op() -> None:
    assert cp.plan_scale("proj", "decode", replicas(1, 2), 2) == cp.ScalePlan()


def test_clone_config_is_the_template_with_the_new_number_name_and_alias() -> None:
    template = inspection(1)
    template["Config"].update({"Hostname": "abc123", "Image": "pdserve:cpu",
                               "Cmd": ["pdserve", "worker"], "Env": ["A=1"]})
    template["HostConfig"] = {"NetworkMode": "proj_default", "ShmSize": 1 << 30, "Init": True}
    template["NetworkSettings"] = {"Networks": {"proj_default": {"IPAddress": "172.18.0.5"},
                                                "proj_extra": {"IPAddress": "172.19.0.5"}}}
    body = cp.clone_config(template, "decode", 2, "proj_decode_2")
    assert "Hostname" not in body  # the engine gives the new container its own
    assert (body["Image"], body["Cmd"], body["Env"]) == ("pdserve:cpu", ["pdserve", "worker"],
                                                         ["A=1"])
    assert body["Labels"][cp.NUMBER] == "2" and body["Labels"][cp.SERVICE] == "decode"
    assert template["Config"]["Labels"][cp.NUMBER] == "1"  # the template is not changed
    assert body["HostConfig"] == template["HostConfig"]
    assert body["NetworkingConfig"] == {
        "EndpointsConfig": {"proj_default": {"Aliases": ["decode", "proj_decode_2"]}}}
    assert cp.other_networks(template) == ["proj_extra"]


@pytest.mark.parametrize("like, want", [("proj_decode_1", "proj_decode_5"),
                                        ("proj-decode-1", "proj-decode-5"),
                                        ("", "proj-decode-5")])
def test_container_name_style(like: str, want: str) -> None:
    assert cp.container_name("proj", "decode", 5, like) == want
