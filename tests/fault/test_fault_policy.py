"""FaultPolicy: the defaults its fields document, signal names accepted, validation that names the option, YAML by class path."""

from __future__ import annotations

import signal

import pytest
from jsonargparse import ArgumentParser

from lightning_ft.fault import FaultPolicy

DEFAULT_FAULT = FaultPolicy()


class Holder:
    """Stands in for the strategy: a constructor argument typed like ``ElasticFT3D(fault=...)``."""

    def __init__(self, fault: FaultPolicy | None = DEFAULT_FAULT) -> None:
        self.fault = fault


def test_defaults_handle_sigterm_and_sigusr1_and_exit_non_zero():
    policy = FaultPolicy()
    assert policy.preemption_signals == (signal.SIGTERM, signal.SIGUSR1)
    assert policy.exit_code != 0
    assert 0 < policy.grace_s < 30
    assert policy.first_step_timeout_s >= policy.hang_timeout_s
    assert policy.health_checks is True
    # Periodic health checks every 1000 steps, a failure logged.
    assert policy.health_check_every_n_steps == 1000 and policy.health_check_action == "log"
    assert policy.health_check_slowdown == 5.0


def test_periodic_health_checks_can_be_turned_off_or_made_to_stop_the_run():
    assert FaultPolicy(health_check_every_n_steps=None).health_check_every_n_steps is None
    policy = FaultPolicy(health_check_every_n_steps=50, health_check_action="checkpoint_and_stop")
    assert (policy.health_check_every_n_steps, policy.health_check_action) == (50, "checkpoint_and_stop")
    assert FaultPolicy(health_check_slowdown=2).health_check_slowdown == 2.0


@pytest.mark.parametrize(
    "given", [("SIGTERM", "usr2"), ["TERM", 12], (signal.SIGTERM, signal.SIGUSR2), ("SIGTERM", "SIGUSR2")]
)
def test_signals_may_be_given_by_member_name_or_number(given):
    assert FaultPolicy(preemption_signals=given).preemption_signals == (signal.SIGTERM, signal.SIGUSR2)


def test_a_single_signal_and_no_signal_are_accepted():
    assert FaultPolicy(preemption_signals="SIGINT").preemption_signals == (signal.SIGINT,)
    assert FaultPolicy(preemption_signals=()).preemption_signals == ()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"preemption_signals": ("SIGNOPE",)}, ValueError, r"preemption_signals=.*'SIGNOPE' is not a signal name"),
        ({"preemption_signals": ("SIGKILL",)}, ValueError, "SIGKILL cannot be caught"),
        ({"preemption_signals": ("SIGTERM", 15)}, ValueError, "listed twice"),
        ({"preemption_signals": (1.5,)}, TypeError, "preemption_signals"),
        ({"exit_code": 0}, ValueError, r"FaultPolicy\(exit_code=0\): must be in 1..255"),
        ({"exit_code": 256}, ValueError, r"exit_code=256"),
        ({"grace_s": 30}, ValueError, r"FaultPolicy\(grace_s=30.0\): must be below 30 s, torchrun's shutdown timeout"),
        ({"grace_s": 0}, ValueError, r"grace_s=0\): must be > 0"),
        ({"hang_timeout_s": "10"}, TypeError, r"hang_timeout_s='10'"),
        ({"hang_timeout_s": 3600}, ValueError, r"first_step_timeout_s=1800.0\): must be >= hang_timeout_s=3600"),
        ({"first_step_timeout_s": 60}, ValueError, r"first_step_timeout_s=60.0\): must be >= hang_timeout_s=600"),
        ({"health_checks": "yes"}, TypeError, r"health_checks='yes'"),
        ({"health_check_every_n_steps": 0}, ValueError, r"health_check_every_n_steps=0\): must be >= 1 optimizer"),
        ({"health_check_every_n_steps": 2.5}, TypeError, r"health_check_every_n_steps=2.5\): must be an int or None"),
        ({"health_check_every_n_steps": True}, TypeError, r"health_check_every_n_steps=True"),
        ({"health_check_action": "stop"}, ValueError, r"health_check_action='stop'"),
        ({"health_check_slowdown": 1.0}, ValueError, r"health_check_slowdown=1.0\): must be a finite ratio > 1"),
        ({"health_check_slowdown": float("inf")}, ValueError, r"health_check_slowdown=inf\): must be a finite"),
        ({"health_check_slowdown": "5"}, TypeError, r"health_check_slowdown='5'\): must be a number"),
    ],
)
def test_bad_options_are_refused_with_the_option_value_and_rule(kwargs, error, match):
    with pytest.raises(error, match=match):
        FaultPolicy(**kwargs)


def test_a_yaml_config_builds_the_policy_by_class_path():
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--holder", type=Holder)
    config = parser.parse_string(
        """
holder:
  class_path: tests.fault.test_fault_policy.Holder
  init_args:
    fault:
      class_path: lightning_ft.fault.FaultPolicy
      init_args: {preemption_signals: [SIGTERM, SIGUSR2], exit_code: 3, grace_s: 25, hang_timeout_s: 120,
                  health_check_every_n_steps: 200, health_check_action: checkpoint_and_stop}
"""
    )
    policy = parser.instantiate(config).holder.fault
    assert policy == FaultPolicy(
        preemption_signals=(signal.SIGTERM, signal.SIGUSR2),
        exit_code=3,
        grace_s=25.0,
        hang_timeout_s=120.0,
        health_check_every_n_steps=200,
        health_check_action="checkpoint_and_stop",
    )
