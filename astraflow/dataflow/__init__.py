"""Data algorithms of the pipeline, as pure functions and small objects (no Kafka, no Faust).

Stream apps pick them by name from the registry (`registry.get(kind, name, **params)`), apply
them to typed records, and record `strategy.ref(app, slot)` in each output's lineage.

| kind | module | names |
|---|---|---|
| reward | `rewards`, `code_reward`, `judge_rewards`, `code_pair_reward` | exact_match, numeric, tool_use, code_tests, weighted, solver_verifier, coder_tester |
| filter | `filters` | staleness, zero_variance, length, dedupe |
| advantage | `advantages` | grpo, dr_grpo, rloo |
| curator | `curators`, `curriculum`, `mixing` | accept_all, filter_solved, greso, curriculum_target, curriculum_ordered, mix |

`prompt_stats.update_prompt_stats` turns one scored group into the next PromptStats of its prompt.
Submodules are imported on demand, so importing this package stays cheap.
"""

from astraflow.dataflow.registry import REGISTRY, Strategy, StrategyRegistry, get, known, register

__all__ = ["REGISTRY", "Strategy", "StrategyRegistry", "get", "known", "register"]
