"""Example processor: scored trajectories in which a tool call failed, copied to their own topic.

    astraflow process run stream_apps.examples.tool_errors:tool_errors --experiment EXP

Reads `scored`, writes `af.<experiment>.tool-errors` (created on start), keyed like its input.
Trajectories whose tools all worked are dropped (counted in the metrics). The copy names the
failed tools in its metadata, so an operator can `astraflow logs` / archive just these.
"""

from __future__ import annotations

import astraflow
from astraflow.records import Trajectory


@astraflow.processor(source="scored", sink="tool-errors", expect=Trajectory)
def tool_errors(t: Trajectory) -> Trajectory | None:
    """Keeps trajectories with at least one failed tool call, naming the tools that failed."""
    failed = sorted({call.name for call in t.tool_calls if call.error is not None})
    if not failed:
        return None
    t.metadata["failed_tools"] = ",".join(failed)
    return t
