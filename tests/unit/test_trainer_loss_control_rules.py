"""The loss a control command selects: validated, built on the configured loss, never half applied."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from astraflow.errors import ConfigError, RLError
from astraflow.models.tiny import init_tiny
from trainers.config import LossSettings
from trainers.loss_control import loss_from_control
from trainers.module import PolicyTrainer

pytestmark = pytest.mark.unit
warnings.filterwarnings("ignore", module="lightning")

CONFIGURED = LossSettings(mode="decoupled", eps_high=0.3, tis_cap=2.0, aggregation="seq_mean_token_mean")


def test_a_command_replaces_the_mode_and_its_fields_of_the_configured_loss() -> None:
    got = loss_from_control(CONFIGURED, "tis", {"tis_cap": "3", "max_staleness": "4", "staleness_weight": "inverse"})
    assert got == replace(CONFIGURED, mode="tis", tis_cap=3.0, max_staleness=4, staleness_weight="inverse")
    assert loss_from_control(CONFIGURED, "decoupled", {"tis_cap": "null"}).tis_cap is None  # JSON null: no cap
    assert loss_from_control(CONFIGURED, "m2po", {}) == replace(CONFIGURED, mode="m2po")  # the rest: configured


@pytest.mark.parametrize(
    ("strategy", "params", "says"),
    [
        ("sgd", {}, "mode"),  # unknown mode
        ("tis", {"tis_cpa": "3"}, "tis_cpa"),  # unknown field (a typo)
        ("ppo", {"eps_low": "1.5"}, "eps_low"),  # out of range
        ("ppo", {"eps_low": "a lot"}, "eps_low"),  # not a number
        ("mis", {"tis_cap": "1"}, "tis_cap > 1"),  # mis masks outside [1/cap, cap]
        ("ppo", {"dual_clip": "0.5"}, "dual_clip"),
        ("ppo", {"mode": "tis"}, "strategy"),  # the mode is the strategy
    ],
)
def test_a_bad_command_is_refused_with_what_is_wrong(strategy: str, params: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        loss_from_control(CONFIGURED, strategy, params)


def test_the_module_keeps_its_loss_when_the_new_one_needs_a_reference_model(tmp_path: Path) -> None:
    tiny = init_tiny(tmp_path / "tiny", vocab_size=512, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    module = PolicyTrainer(tiny, CONFIGURED)
    with pytest.raises(RLError, match="reference model"):
        module.set_loss(loss_from_control(CONFIGURED, "ppo", {"kl_coef": "0.1"}))
    assert module.loss_settings == CONFIGURED and module.loss_config.mode == "decoupled"
    module.set_loss(loss_from_control(CONFIGURED, "mis", {"tis_cap": "3"}))
    assert module.loss_config.mode == "mis" and module.loss_config.tis_cap == 3.0
