"""ElasticPolicy: defaults from docs/elastic.md, validation that names the option, construction from YAML by class path."""

from __future__ import annotations

import dataclasses

import pytest
from jsonargparse import ArgumentParser

from lightning_ft.elastic import ElasticPolicy

DEFAULT_ELASTIC = ElasticPolicy()


class Holder:
    """Stands in for the strategy: a constructor argument typed like ``ElasticFT3D(elastic=...)``."""

    def __init__(self, elastic: ElasticPolicy | None = DEFAULT_ELASTIC) -> None:
        self.elastic = elastic


def from_yaml(text: str) -> ElasticPolicy | None:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--holder", type=Holder)
    return parser.instantiate(parser.parse_string(text)).holder.elastic


def test_defaults_keep_the_global_batch_and_scale_the_learning_rate_linearly():
    policy = ElasticPolicy()
    assert (policy.batch, policy.lr_scaling, policy.lr_warmup_steps) == ("keep_global", "linear", 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.batch = "keep_local"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"batch": "global"},
            ValueError,
            r"ElasticPolicy\(batch='global'\): must be one of 'keep_global', 'keep_local'",
        ),
        ({"lr_scaling": "cubic"}, ValueError, r"lr_scaling='cubic'.*'linear', 'sqrt', 'none'"),
        ({"lr_warmup_steps": -1}, ValueError, r"lr_warmup_steps=-1\): must be >= 0"),
        ({"lr_warmup_steps": 1.5}, TypeError, r"lr_warmup_steps=1.5\): must be an int"),
    ],
)
def test_bad_options_are_refused_with_the_option_value_and_rule(kwargs, error, match):
    with pytest.raises(error, match=match):
        ElasticPolicy(**kwargs)


def test_positional_arguments_are_refused():
    with pytest.raises(TypeError):
        ElasticPolicy("keep_local")


def test_a_yaml_config_builds_the_policy_by_class_path():
    policy = from_yaml(
        """
holder:
  class_path: tests.elastic.test_elastic_policy.Holder
  init_args:
    elastic:
      class_path: lightning_ft.elastic.ElasticPolicy
      init_args: {batch: keep_local, lr_scaling: sqrt, lr_warmup_steps: 50}
"""
    )
    assert policy == ElasticPolicy(batch="keep_local", lr_scaling="sqrt", lr_warmup_steps=50)


def test_a_yaml_config_can_turn_elasticity_off_and_is_checked_against_the_choices():
    assert (
        from_yaml("holder:\n  class_path: tests.elastic.test_elastic_policy.Holder\n  init_args: {elastic: null}")
        is None
    )
    with pytest.raises(Exception, match="keep_global"):
        from_yaml(
            "holder:\n  class_path: tests.elastic.test_elastic_policy.Holder\n  init_args: {elastic: {batch: all}}"
        )
