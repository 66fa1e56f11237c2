"""bench/multi_policy.py's time-to-target rule: smoothed curves, a target between the warm start
and the lowest plateau, reached by every schedule, the same rule for each."""

from __future__ import annotations

# At collection (see test_bench_vs_trl.py): importing the benchmark imports lightning.
import _rl
import multi_policy as mp
import pytest

from astraflow.models.tiny import init_tiny
from trainers.config import TrainerSettings

pytestmark = pytest.mark.unit


def run(mode: str, solver: list[float], verifier: list[float], dt: float) -> mp.Run:
    r = mp.Run(mode, 1.5, wall_s=dt * (len(solver) - 1))
    for p, figures in (("solver", solver), ("verifier", verifier)):
        r.policies[p].score = [(i, i * dt, f) for i, f in enumerate(figures)]
        r.policies[p].trained = 64 * (len(figures) - 1)
    return r


def test_smoothed_is_a_trailing_mean_known_at_each_snapshot() -> None:
    curve = [(0, 0.0, 0.5), (1, 1.0, 0.8), (2, 2.0, 0.5), (3, 3.0, 0.8)]
    assert [round(s, 4) for _, _, s in mp.smoothed(curve, 3)] == [0.5, 0.65, 0.6, 0.7]
    assert [t for _, t, _ in mp.smoothed(curve, 3)] == [0.0, 1.0, 2.0, 3.0]


def test_target_lies_halfway_to_the_lowest_plateau_and_both_reach_it() -> None:
    # A fast schedule (1 s a step) whose last three snapshots average 0.8; a slow one (4 s a
    # step) that ends higher. One lucky early snapshot (0.75 at step 1) must not count.
    fast = run("pipeline", [0.5, 0.75, 0.55, 0.6, 0.7, 0.8, 0.8, 0.8], [0.7] * 8, 1.0)
    slow = run("trainer-centred", [0.5, 0.55, 0.6, 0.62, 0.68, 0.8, 0.9, 0.9], [0.7] * 8, 4.0)
    target = mp.targets_of([slow, fast], "solver", 0.5, 3)
    assert target == pytest.approx(0.5 + 0.5 * (0.8 - 0.5))
    old = {"solver": 0.55, "verifier": 0.75}
    fast_row = fast.summary({"solver": target, "verifier": None}, old, 3, 128)
    slow_row = slow.summary({"solver": target, "verifier": None}, old, 3, 128)
    a, b = fast_row["solver"], slow_row["solver"]
    # smoothed, fast: 0.5, 0.625, 0.6, 0.633, 0.617, 0.7 (step 5); slow: ..., 0.633, 0.7 (step 5)
    assert (a["steps_to_target"], a["time_to_target_s"]) == (5, 5.0)
    assert (b["steps_to_target"], b["time_to_target_s"]) == (5, 20.0)
    assert a["final"] == pytest.approx(0.8) and a["final_last"] == pytest.approx(0.8)
    assert b["final"] == pytest.approx(2.6 / 3) and b["final_last"] == pytest.approx(0.9)
    # the old rule (first raw snapshot at or above start + 0.05) takes the lucky snapshot
    assert (a["time_to_old_target_s"], b["time_to_old_target_s"]) == (1.0, 4.0)
    v = mp.ratios(fast_row, slow_row, "solver")
    assert v["time_to_target"] == pytest.approx(4.0) and v["time_to_old_target"] == pytest.approx(4.0)
    assert v["time_to_target_bound"] == v["time_to_old_target_bound"] == ""  # both reached: exact
    assert v["samples_per_s"] == pytest.approx(4.0) and v["final_minus_baseline"] == pytest.approx(0.8 - 2.6 / 3)


def test_no_target_when_no_schedule_ends_above_the_warm_start() -> None:
    flat = run("pipeline", [0.5, 0.6, 0.4, 0.5, 0.45], [0.7] * 5, 1.0)
    up = run("trainer-centred", [0.5, 0.6, 0.7, 0.8, 0.9], [0.7] * 5, 1.0)
    assert mp.targets_of([up, flat], "solver", 0.5, 3) is None
    assert mp.targets_of([up, flat], "verifier", 0.5, 3) is None
    out = flat.summary({"solver": None, "verifier": None}, {"solver": 0.55, "verifier": 0.75}, 3, 128)
    assert out["solver"]["time_to_target_s"] is None and out["solver"]["time_to_old_target_s"] == 1.0


def test_first_version_hops_follow_the_groups_of_the_first_step(tmp_path) -> None:
    import json

    from _pipeline_pair import _first_version_hops

    # The first step trained group g1's samples (train partition 0, offsets 0-1); g2 came later.
    (tmp_path / "trained-samples.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"sample_id": "g1/0#solver", "step": 1, "partition": 0, "offset": 0},
        {"sample_id": "g1/1#solver", "step": 1, "partition": 0, "offset": 1},
        {"sample_id": "g2/0#solver", "step": 2, "partition": 0, "offset": 2}]))
    tasks = {(0, 0): ("g1", 100.0), (1, 0): ("g2", 100.5)}
    rollouts = {(0, 0): ("g1", 100.9), (0, 1): ("g1", 101.0), (1, 0): ("g2", 103.0)}
    scored = {(0, 0): ("g1", 101.2), (0, 1): ("g1", 101.3), (1, 0): ("g2", 103.1)}
    train = {(0, 0): ("g1", 101.5), (0, 1): ("g1", 101.6), (0, 2): ("g2", 103.2)}
    hops = _first_version_hops(tmp_path, tasks, rollouts, scored, train, (102.6, 0.4, 0.1), 102.7, 100.0)
    assert hops == {"first_rollout": 0.9, "tasks": 0.0, "rolled_out": 1.0, "scored": 1.3, "curated": 1.6,
                    "step_began": 2.1, "step_ended": 2.5, "published": 2.6, "followed": 2.7}


def test_group_diagnostics_ties_each_groups_staleness_to_its_slowest_call(tmp_path) -> None:
    import json
    from types import SimpleNamespace as NS

    from _pipeline_pair import _trained_log, group_diagnostics

    def traj(group: str, calls: list[tuple[float, str | None]], finished_ms: int) -> NS:
        return NS(group_id=group, tool_calls=[NS(latency_s=lat, error=err) for lat, err in calls],
                  timings=NS(finished_at=finished_ms))

    def sample(group: str, i: int, min_version: int, reward: float) -> NS:
        return NS(sample_id=f"{group}/{i}#solver", group_id=group, min_version=min_version, reward=reward)

    # r-0: fast (no call over 1 s), trained at step 1 from version 0. r-1: a call cut at the
    # node's timeout, trained at step 3 from version 0 (2 behind). r-2: one 6 s call, trained at
    # step 2 from version 0 (1 behind). r-3 was trained at step 4, after the `steps` counted.
    trajectories = [traj("r-0", [(0.2, None)], 1_000), traj("r-0", [], 1_500),
                    traj("r-1", [(0.3, None)], 2_000), traj("r-1", [(10.0, "tool calc timed out after 10s")], 12_000),
                    traj("r-2", [(6.0, None)], 7_000), traj("r-3", [], 3_000)]
    samples = {"solver": [sample("r-0", 0, 0, 1.0), sample("r-0", 1, 0, 0.0), sample("r-1", 0, 0, 1.0),
                          sample("r-1", 1, 0, 0.0), sample("r-2", 0, 0, 1.0), sample("r-3", 0, 2, 1.0)]}
    (tmp_path / "trained-samples.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"sample_id": "r-0/0#solver", "step": 1}, {"sample_id": "r-0/1#solver", "step": 1},
        {"sample_id": "r-2/0#solver", "step": 2}, {"sample_id": "r-1/0#solver", "step": 3},
        {"sample_id": "r-1/1#solver", "step": 3}, {"sample_id": "r-3/0#solver", "step": 4}]))
    out = group_diagnostics(trajectories, samples, {"solver": _trained_log(tmp_path)}, 3, 0.0, 10.0)["solver"]
    assert out["by_slowest_call"] == {"<1s": {"groups": 1, "staleness": 0.0, "reward": 0.5},
                                      "5-10s": {"groups": 1, "staleness": 1.0, "reward": 1.0},
                                      "cut": {"groups": 1, "staleness": 2.0, "reward": 0.5}}
    assert out["by_staleness"]["0"] == {"samples": 2, "reward": 0.5}
    assert out["by_staleness"]["2"] == {"samples": 2, "reward": 0.5}
    assert sum(b["samples"] for b in out["by_staleness"].values()) == 5  # r-3's step 4 is past `steps`
    assert [(g["group"], g["issued"], g["step"], g["cut"], g["ended_s"]) for g in out["groups"]] == [
        ("r-0", 0, 1, False, 1.5), ("r-2", 2, 2, False, 7.0), ("r-1", 1, 3, True, 12.0)]


def test_staleness_limits_become_curates_per_policy_filter_slots() -> None:
    from _pipeline_pair import staleness_controls

    assert mp.parse_limits(mp.PIPELINE_MAX_STALENESS) == {}  # curate's default limit unless asked
    assert mp.parse_limits("solver=2") == {"solver": 2}
    assert mp.parse_limits("verifier=3, solver=1") == {"verifier": 3, "solver": 1}
    assert mp.parse_limits("none") == {} == mp.parse_limits("")
    for bad in ("solver", "critic=2", "solver=-1", "solver=x"):
        with pytest.raises(ValueError):
            mp.parse_limits(bad)
    assert staleness_controls({"verifier": 3, "solver": 2}) == [
        ("filter.staleness@solver", "staleness", {"max_staleness": "2"}),
        ("filter.staleness@verifier", "staleness", {"max_staleness": "3"})]


def test_the_in_process_learner_optimises_with_the_trainers_settings(tmp_path) -> None:
    # The trainer-centred loop and the pipeline's trainers must differ in scheduling only:
    # AdamW's weight decay (torch's default is 0.01, the trainer's 0), betas and the clip.
    model = init_tiny(tmp_path / "m", vocab_size=512, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    learner, trainer = _rl.Learner(str(model)), TrainerSettings()
    group = learner.opt.param_groups[0]
    assert (group["lr"], group["weight_decay"], tuple(group["betas"])) == (_rl.LR, trainer.weight_decay, trainer.betas)
    assert learner.grad_clip == trainer.grad_clip


def test_every_schedule_cuts_tool_calls_where_the_node_does():
    """The in-process schedules (multi_policy's, `_rl.one_run`'s, vs_trl's TRL rollout) cut a tool
    call at the pipeline node's timeout: a side that waits longer measures calls the node cut."""
    import inspect

    import vs_trl

    from astraflow.raas.node import NodeSettings

    assert _rl.TOOL_TIMEOUT_S == NodeSettings("exp").tool_timeout_s == mp.TOOL_TIMEOUT_S
    for fn in (_rl.one_run, vs_trl):
        src = inspect.getsource(fn)
        assert "ToolBox(" in src and "timeout_s=" in src
        assert all("TOOL_TIMEOUT_S" in line for line in src.splitlines() if "ToolBox(" in line), fn


def test_trainer_loss_fields_reach_both_sides(tmp_path) -> None:
    # `--trainer-loss` sets the same loss fields on the pipeline's trainer of a policy (its
    # `trainer.loss.<field>` overrides, which the trainer's config accepts) and on the in-process
    # learner of that policy; the other policy keeps its defaults.
    from _pipeline_pair import _roles, loss_sets

    from astraflow.config import load_config
    from trainers.config import TrainRunConfig

    assert mp.parse_loss(mp.TRAINER_LOSS) == {} == mp.parse_loss("none") == mp.parse_loss("")  # untuned default
    loss = mp.parse_loss("solver.max_staleness=2, solver.staleness_weight=inverse")
    assert loss == {"solver": {"max_staleness": 2, "staleness_weight": "inverse"}}
    assert mp.parse_loss("verifier.tis_cap=none,verifier.eps_high=0.3") == {"verifier": {"tis_cap": None, "eps_high": 0.3}}
    for bad in ("max_staleness=2", "critic.max_staleness=2", "solver.nonsense=1", "solver.max_staleness=-1",
                "solver.staleness_weight=sometimes", "solver.max_staleness="):
        with pytest.raises(ValueError):
            mp.parse_loss(bad)
    sets = loss_sets(loss["solver"])
    assert sets == ["trainer.loss.max_staleness=2", "trainer.loss.staleness_weight=inverse"]
    cfg = load_config(None, sets, model=TrainRunConfig)
    assert (cfg.trainer.loss.mode, cfg.trainer.loss.max_staleness, cfg.trainer.loss.staleness_weight) == (
        "decoupled", 2, "inverse")
    roles = {r.name: r.cmd for r in _roles("e", ("solver", "verifier"), {"solver": "s", "verifier": "v"}, tmp_path / "d",
                                           tmp_path, staleness=1, sigma=2.0, median_s=0.2, seed=0, bonus=0.0, env={},
                                           trainer_loss=loss)}
    assert all(s in roles["trainer-solver"] for s in sets)
    assert not any("trainer.loss." in a for a in roles["trainer-verifier"])
    learner = mp.learner_loss(loss["solver"])
    assert (learner.mode, learner.max_staleness, learner.staleness_weight) == ("decoupled", 2, "inverse")
    # the in-process learners' loss is the pipeline trainer's, field for field
    assert mp.learner_loss({}) == cfg.trainer.loss.__class__() == load_config(None, [], model=TrainRunConfig).trainer.loss
    assert mp.learner_loss({}) == mp.learner_loss(mp.parse_loss("none").get("solver", {}))


def test_the_pipeline_runs_its_staleness_filters_either_way(tmp_path) -> None:
    from _pipeline_pair import _roles

    def trainer_args(check: bool) -> list[str]:
        roles = _roles("e", ("solver", "verifier"), {"solver": "s", "verifier": "v"}, tmp_path / "d", tmp_path,
                       staleness=1, sigma=2.0, median_s=0.2, seed=0, bonus=0.0, env={}, staleness_check=check)
        return next(r.cmd for r in roles if r.name == "trainer-solver")

    assert "trainer.max_staleness=null" in trainer_args(False) and "trainer.max_staleness=null" not in trainer_args(True)
    assert mp.staleness_filters("off") is False and mp.staleness_filters("none") is True
    assert mp.parse_limits("off") == {} and mp.parse_limits("solver=2") == {"solver": 2}


def test_ppo_clip_and_the_trainers_decoupled_loss_agree_on_policy_and_differ_on_stale_data() -> None:
    # Module doc, "Trainer loss": with one optimizer step per batch (no proximal policy given),
    # on-policy tokens (logprobs = behaviour) get the same gradient from both; stale ones do not.
    import torch

    from astraflow.rl import PolicyLossConfig, policy_loss

    def grad(config: PolicyLossConfig, behaviour_shift: float) -> torch.Tensor:
        torch.manual_seed(0)
        lp = (-torch.rand(4, 6) - 0.1).requires_grad_()
        adv, mask = torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(4, 6)
        policy_loss(lp, lp.detach() + behaviour_shift, adv, mask, config).loss.backward()
        return lp.grad

    decoupled = mp.learner_loss({})
    assert torch.allclose(grad(PolicyLossConfig(mode="ppo"), 0.0), grad(decoupled, 0.0))
    assert not torch.allclose(grad(PolicyLossConfig(mode="ppo"), -0.5), grad(decoupled, -0.5))
