"""The shared size check and divisor helper: one exception type and one wording per mistake, wherever it is made."""

from __future__ import annotations

import re

import pytest

from lightning_ft.parallel import ClusterShape, ParallelConfig
from lightning_ft.parallel.internal import check_positive_int
from lightning_ft.parallel.validation import divisors, render_call


@pytest.mark.parametrize(
    ("value", "allow_auto", "error", "message"),
    [
        ("4", False, TypeError, "Owner(size='4'): expected a positive int, got str"),
        ("4", True, TypeError, "Owner(size='4'): expected a positive int or \"auto\", got str"),
        ("auto", False, TypeError, "Owner(size='auto'): expected a positive int, got str"),
        (2.0, False, TypeError, "Owner(size=2.0): expected a positive int, got float"),
        (True, False, TypeError, "Owner(size=True): expected a positive int, got bool"),
        (None, True, TypeError, 'Owner(size=None): expected a positive int or "auto", got NoneType'),
        (0, False, ValueError, "Owner(size=0): must be at least 1"),
        (-3, True, ValueError, "Owner(size=-3): must be at least 1"),
    ],
)
def test_a_wrong_type_is_a_type_error_and_a_bad_value_a_value_error_naming_the_call(value, allow_auto, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        check_positive_int("Owner", "size", value, allow_auto=allow_auto)


def test_valid_sizes_and_auto_where_allowed_pass():
    for value in (1, 2, 1024):
        check_positive_int("Owner", "size", value)
    check_positive_int("Owner", "size", "auto", allow_auto=True)


def test_without_an_owner_the_message_is_the_option_alone():
    assert render_call(None, tensor_parallel_size=3) == "tensor_parallel_size=3"
    assert render_call("ElasticFT3D", a=1, b="x") == "ElasticFT3D(a=1, b='x')"
    with pytest.raises(ValueError, match=r"^num_microbatches=0: must be at least 1$"):
        check_positive_int(None, "num_microbatches", 0)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (dict(tensor_parallel_size="4"), TypeError, "ElasticFT3D(tensor_parallel_size='4'): expected"),
        (dict(pipeline_parallel_size=0), ValueError, "ElasticFT3D(pipeline_parallel_size=0): must be at least 1"),
        (dict(num_nodes=1.5), TypeError, "ElasticFT3D(num_nodes=1.5): expected a positive int, got float"),
    ],
)
def test_parallel_config_reports_size_mistakes_through_the_shared_check(options, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}"):
        ParallelConfig(**{"devices_per_node": 4, "owner": "ElasticFT3D", **options})


def test_cluster_shape_reports_size_mistakes_through_the_shared_check():
    with pytest.raises(TypeError, match=re.escape("ClusterShape(devices_per_node='8'): expected a positive int")):
        ClusterShape(devices_per_node="8")


def test_divisors_are_every_divisor_in_ascending_order():
    for n in range(1, 500):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    assert divisors(2**20 * 3)[-3:] == [2**20, 2**19 * 3, 2**20 * 3]
