"""The local autoscaler: the decision (pure, KEDA's rule: ceil(lag / target), clamped, slow to scale down)
and a run whose rollout fleet grows on its consumer's lag and whose new worker takes prompts."""

from __future__ import annotations

import threading

import pytest

from services.launcher.autoscale import AutoscaleRule, desired_count
from services.launcher.supervisor import Supervisor
from services.runtime.config import ConfigError
from tests.conftest import run_file, wait_for

RULE = AutoscaleRule(min=1, max=4, target_pending=8, cooldown_s=30.0)


def test_scales_up_at_once_to_ceil_lag_over_target_clamped():
    assert desired_count(1, 0, RULE, None, 0.0) == (1, None)
    assert desired_count(1, 9, RULE, None, 0.0) == (2, None)
    assert desired_count(1, 24, RULE, None, 0.0) == (3, None)
    assert desired_count(2, 1000, RULE, None, 0.0) == (4, None)
    assert desired_count(0, 0, AutoscaleRule(min=0, max=2), None, 0.0) == (0, None)


def test_scales_down_only_after_the_cooldown_and_a_rise_resets_it():
    assert desired_count(3, 0, RULE, None, 100.0) == (3, 100.0)  # lag allows 1: the cooldown starts
    assert desired_count(3, 0, RULE, 100.0, 120.0) == (3, 100.0)
    assert desired_count(3, 20, RULE, 100.0, 125.0) == (3, None)  # needs 3 again: the clock resets
    assert desired_count(3, 0, RULE, 125.0, 160.0) == (1, None)  # allowed for 35 s >= 30 s


def test_rules_must_name_a_consumer_service_of_the_layout(tmp_path):
    cfg = run_file(tmp_path, "m", run_id="as", services={"trainer": 1, "rollout": 1},
                   launcher={"autoscale": {"trainer": {"max": 2}}}, trainer={})
    with pytest.raises(ConfigError, match="launcher.autoscale.trainer"):
        Supervisor(str(cfg), quiet=True)


@pytest.mark.slow
def test_the_rollout_fleet_grows_on_its_consumers_lag(tmp_path, loop_model_dir):
    cfg = run_file(tmp_path, loop_model_dir, run_id="autoscale", services={"trainer": 1, "rollout": 1, "judge": 1},
                   launcher={"autoscale": {"rollout": {"min": 1, "max": 2, "target_pending": 2, "period_s": 1.0}}},
                   common={"heartbeat_s": 1.0, "drain_timeout_s": 3.0},
                   trainer={"groups_per_step": 4, "total_steps": 100000, "max_staleness": 1,
                            "eval": {"prompts": 8}},
                   rollout={"max_tickets": 2})
    sup = Supervisor(str(cfg), quiet=True)
    try:
        sup.start()
        sup.start_heartbeat_monitor()
        threading.Thread(target=sup.wait, name="supervisor", daemon=True).start()
        wait_for(lambda: any(e["event"] == "scale" and e["count"] == 2 for e in sup.events), 300,
                 "the autoscaler to add a rollout worker", interval=0.5)
        log = tmp_path / "run" / "logs" / "rollout-1.log"
        wait_for(lambda: log.is_file() and "applied weights" in log.read_text(), 300,
                 "the added worker to load the current weights", interval=0.5)
        assert sup.launcher.services["rollout"] == 2
    finally:
        sup.stop()
