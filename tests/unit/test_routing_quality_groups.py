"""bench.routing_quality's policy selection and its table of DualMap over the best baseline and
over the best peer (no simulation runs here)."""

from __future__ import annotations

import argparse

import pytest

from bench.routing_quality import main, policy_names, print_table
from router.policy.registry import BASELINES, PEERS, PREFILL_POLICIES


def test_policy_names_expand_groups_and_keep_dualmap_first() -> None:
    assert policy_names("all") == list(PREFILL_POLICIES)
    assert policy_names("peers") == ["dualmap", *PEERS]
    assert policy_names("least_loaded,peers,least_loaded") == ["dualmap", "least_loaded", *PEERS]
    assert policy_names("baselines,dualmap") == ["dualmap", *BASELINES]
    with pytest.raises(KeyError):
        policy_names("nope")


def test_unknown_or_empty_policy_list_is_refused() -> None:
    assert main(["--policies", "nope"]) == 2
    assert main(["--policies", "dualmap"]) == 2


def test_table_reports_dualmap_over_the_best_of_each_group(
        capsys: pytest.CaptureFixture[str]) -> None:
    row = {"shape": "default", "seed": 4, "held_out": False, "mean_prompt_tokens": 900,
           "capacity_rps": {"dualmap": 30.0, "least_loaded": 20.0, "dynamo_kv": 25.0},
           "best_baseline": "dynamo_kv", "dualmap_over_best": 1.2, "ceiling_rps": 40.0,
           "groups": {"baselines": {"best": "least_loaded", "dualmap_over": 1.5,
                                    "ceiling_over": 2.0},
                      "peers": {"best": "dynamo_kv", "dualmap_over": 1.2,
                                "ceiling_over": 1.6}}}
    print_table([row], argparse.Namespace(instances=2, requests=300, ttft_slo_s=2.0))
    out = capsys.readouterr().out.splitlines()
    assert "DM/base" in out[1] and "DM/peer" in out[1]
    assert "1.50x" in out[2] and "1.20x" in out[2] and "least_loaded" in out[2]
    assert "ceil/peer" in out[1] and "40.0" in out[2] and "1.60x" in out[2]
    assert any(line.startswith("tuned: DualMap / best peer geometric mean 1.20x")
               and line.endswith("the ceiling / best peer 1.60x (min 1.60x)") for line in out)
