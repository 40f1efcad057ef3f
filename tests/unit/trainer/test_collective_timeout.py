"""`flexrl.trainer.collective_timeout_s`: validated, and the policy group's timeout where set."""

from __future__ import annotations

import pytest

from flexrl_ds.trainer.config import TrainerConfig


def test_the_group_timeout_is_the_collective_one_where_set_else_timeout_s():
    assert TrainerConfig(timeout_s=300.0).group_timeout_s == 300.0
    assert TrainerConfig(timeout_s=300.0, collective_timeout_s=30.0).group_timeout_s == 30.0


@pytest.mark.parametrize("value", [0.0, -5.0, 301.0])
def test_a_collective_timeout_not_in_0_to_timeout_s_is_refused(value):
    with pytest.raises(ValueError, match=r"flexrl.trainer.collective_timeout_s: must be positive and at most timeout_s"):
        TrainerConfig(timeout_s=300.0, collective_timeout_s=value)
