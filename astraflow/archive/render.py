"""Shows records to people (`logs show`) and to machines (`logs show --json`).

Records are rendered from the decoded dict in the current schema version, not from the typed
classes, so records of any archived version display. Model and tool text goes through
`rich.text.Text`, never markup, so brackets in model output print as they are.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any

import numpy as np
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.text import Text

from astraflow.archive.format import ArchivedRecord

# Packed little-endian arrays (DESIGN.md, "Wire format"), by field name.
PACKED = {
    "token_ids": "<i4",
    "versions": "<i4",
    "logprobs": "<f4",
    "behaviour_logprobs": "<f4",
    "loss_mask": "u1",
}
ROLE_STYLE = {"prompt": "cyan", "system": "cyan", "user": "cyan", "assistant": "green", "tool": "yellow"}


def fmt_ts(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


# ---- JSON -------------------------------------------------------------------------------------


def jsonable(value: Any, name: str = "") -> Any:
    """Decoded Avro data as JSON values: packed arrays become lists, other bytes base64."""
    if isinstance(value, dict):
        return {k: jsonable(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v, name) for v in value]
    if isinstance(value, bytes | bytearray | memoryview):
        dtype = PACKED.get(name)
        if dtype is not None and len(value) % np.dtype(dtype).itemsize == 0:
            return np.frombuffer(value, dtype=dtype).tolist()
        return {"base64": base64.b64encode(bytes(value)).decode()}
    return value


def record_json(rec: ArchivedRecord, fullname: str | None, datum: dict[str, Any] | None, error: str | None = None) -> dict[str, Any]:
    """One record for `--json`: Kafka coordinates under `_`-names, then the fields."""
    out: dict[str, Any] = {
        "_topic": rec.topic,
        "_partition": rec.partition,
        "_offset": rec.offset,
        "_timestamp": rec.timestamp_ms,
        "_key": rec.key.decode("utf-8", "replace") if rec.key is not None else None,
        "_schema": fullname,
    }
    if rec.headers:
        out["_headers"] = {k: (v.decode("utf-8", "replace") if v is not None else None) for k, v in rec.headers}
    if error is not None:
        out["_error"] = error
        out["_bytes"] = len(rec.value or b"")
    if datum is not None:
        out.update(jsonable(datum))
    return out


# ---- people -----------------------------------------------------------------------------------


def _clip(text: str, max_chars: int) -> str:
    if max_chars and len(text) > max_chars:
        return text[:max_chars] + f" … ({len(text) - max_chars:,} more characters)"
    return text


def _arr(seg: dict[str, Any], name: str) -> np.ndarray:
    return np.frombuffer(seg.get(name) or b"", dtype=PACKED[name])


def _version_range(v: np.ndarray) -> str:
    v = v[v >= 0]
    if not len(v):
        return ""
    lo, hi = int(v.min()), int(v.max())
    return f"v{lo}" if lo == hi else f"v{lo}–v{hi}"


def _line(*parts: tuple[str, str] | str) -> Text:
    """A line of `label value` pairs separated by dots."""
    t = Text()
    for i, p in enumerate(parts):
        if i:
            t.append(" · ", "dim")
        if isinstance(p, tuple):
            t.append(p[0] + " ", "bold")
            t.append(p[1])
        else:
            t.append(p)
    return t


def _header(rec: ArchivedRecord) -> str:
    return f"{rec.topic} p{rec.partition} @{rec.offset} · {fmt_ts(rec.timestamp_ms)}"


def render_trajectory(d: dict[str, Any], rec: ArchivedRecord, max_text: int = 2000) -> RenderableType:
    rows: list[RenderableType] = [
        _line(("task", d["task_id"]), ("group", d["group_id"]), ("sample", f"{d['sample_index'] + 1}/{d['group_size']}"),
              ("prompt", d["prompt_id"]), ("dataset", d["dataset"]), ("workflow", d["workflow"])),
    ]
    reward = "unscored" if d.get("reward") is None else f"{d['reward']:.4g}"
    comps = ", ".join(f"{k} {v:.4g}" for k, v in sorted((d.get("reward_components") or {}).items()))
    rows.append(_line(("status", str(d.get("status"))), ("reward", reward + (f" ({comps})" if comps else ""))))
    if d.get("error"):
        rows.append(Text(f"error: {d['error']}", "red"))
    if d.get("final_answer") is not None or d.get("reference") is not None:
        rows.append(_line(("answer", repr(d.get("final_answer"))), ("reference", str(d.get("reference")))))
    node = d.get("node") or {}
    rows.append(_line(("node", node.get("node_id", "?")), node.get("hardware", ""), node.get("region", ""),
                      ("backend", node.get("backend", ""))))
    tm = d.get("timings") or {}
    if tm:
        q, s, f = tm["queued_at"], tm["started_at"], tm["finished_at"]
        rows.append(_line(("queued", fmt_ts(q)), ("started", f"+{(s - q) / 1000:.2f} s"),
                          ("finished", f"+{(f - q) / 1000:.2f} s"), ("generate", f"{tm['generate_s']:.2f} s"),
                          ("tools", f"{tm['tool_s']:.2f} s")))
    per_policy: dict[str, list[np.ndarray]] = {}
    for seg in d["segments"]:
        per_policy.setdefault(seg["policy"], []).append(_arr(seg, "versions"))
    versions = []
    for pol, vs in per_policy.items():
        allv = np.concatenate(vs) if vs else np.zeros(0, np.int32)
        vr = _version_range(allv)
        versions.append(f"{pol} {vr} ({int((allv >= 0).sum())} sampled tokens)" if vr else f"{pol} (no sampled tokens)")
    rows.append(_line(("versions", "; ".join(versions))))
    if d.get("lineage"):
        rows.append(_line(("lineage", ", ".join(f"{s['app']}/{s['slot']}={s['name']} v{s['version']}" for s in d["lineage"]))))

    rows.append(Text("turns", "bold underline"))
    calls = sorted(d.get("tool_calls") or [], key=lambda c: c["turn"])
    shown: set[int] = set()
    turn = -1
    for seg in d["segments"]:
        role = seg["role"]
        ids = _arr(seg, "token_ids")
        head = Text(f"[{role}]", ROLE_STYLE.get(role, "magenta") + " bold")
        head.append(f" {seg['policy']} · {len(ids)} tok", "dim")
        if role == "assistant":
            turn += 1
            mask = _arr(seg, "loss_mask").astype(bool)
            lp = _arr(seg, "logprobs")
            vr = _version_range(_arr(seg, "versions"))
            extra = f" · turn {turn}" + (f" · {vr}" if vr else "")
            if mask.any() and len(lp) == len(mask):
                extra += f" · mean logprob {float(lp[mask].mean()):.3f}"
            head.append(extra, "dim")
        rows.append(head)
        if seg.get("text"):
            rows.append(Text("  " + _clip(seg["text"], max_text).replace("\n", "\n  ")))
        if role == "assistant":
            for i, c in enumerate(calls):
                if c["turn"] == turn and i not in shown:
                    shown.add(i)
                    rows.append(_tool_call(c, max_text))
    for i, c in enumerate(calls):
        if i not in shown:
            rows.append(_tool_call(c, max_text))
    title = Text(f"trajectory {d['trajectory_id']}", "bold")
    return Panel(Group(*rows), title=title, subtitle=_header(rec), title_align="left", subtitle_align="right")


def _tool_call(c: dict[str, Any], max_text: int) -> Text:
    t = Text("  ⚙ ", "yellow")
    t.append(f"{c['name']}({_clip(c['arguments'], max_text)})", "yellow")
    if c.get("error"):
        t.append(f" ✗ {c['error']}", "red")
    else:
        t.append(f" → {_clip(c['result'], max_text)}")
    t.append(f"  ({c['latency_s']:.3f} s, after turn {c['turn']})", "dim")
    return t


def render_train_sample(d: dict[str, Any], rec: ArchivedRecord) -> RenderableType:
    mask = np.frombuffer(d["loss_mask"], "u1").astype(bool)
    lp = np.frombuffer(d["behaviour_logprobs"], "<f4")
    rows: list[RenderableType] = [
        _line(("policy", d["policy"]), ("trajectory", d["trajectory_id"]), ("group", d["group_id"]), ("prompt", d["prompt_id"])),
        _line(("advantage", f"{d['advantage']:.4g}"), ("reward", f"{d['reward']:.4g}"), ("min version", str(d["min_version"])),
              ("versions", _version_range(np.frombuffer(d["versions"], "<i4")) or "-")),
        _line(("tokens", str(len(mask))), ("trained", str(int(mask.sum()))),
              ("mean behaviour logprob", f"{float(lp[mask].mean()):.3f}" if mask.any() and len(lp) == len(mask) else "-")),
    ]
    return Panel(Group(*rows), title=Text(f"train sample {d['sample_id']}", "bold"), subtitle=_header(rec),
                 title_align="left", subtitle_align="right")


def render_generic(fullname: str, d: dict[str, Any], rec: ArchivedRecord, max_text: int = 2000) -> RenderableType:
    rows = []
    for k, v in d.items():
        if isinstance(v, bytes | bytearray):
            shown = f"<{len(v):,} bytes>"
        else:
            shown = _clip(str(v), max_text)
        t = Text(f"{k} ", "bold")
        t.append(shown)
        rows.append(t)
    return Panel(Group(*rows), title=Text(fullname, "bold"), subtitle=_header(rec), title_align="left", subtitle_align="right")


def render_record(rec: ArchivedRecord, fullname: str | None, datum: dict[str, Any] | None, error: str | None = None,
                  max_text: int = 2000) -> RenderableType:
    """The rich renderable for one record."""
    if datum is None or fullname is None:
        return Panel(Text(f"cannot decode {len(rec.value or b''):,} bytes: {error}", "red"),
                     title=Text("undecodable record", "bold red"), subtitle=_header(rec), title_align="left")
    if fullname == "astraflow.Trajectory":
        return render_trajectory(datum, rec, max_text)
    if fullname == "astraflow.TrainSample":
        return render_train_sample(datum, rec)
    return render_generic(fullname, datum, rec, max_text)


ID_FIELDS = ("trajectory_id", "task_id", "group_id", "sample_id", "prompt_id")


def matches_id(rec: ArchivedRecord, datum: dict[str, Any] | None, ident: str) -> bool:
    """Whether a record is the one `--id` names: any id field, or the Kafka key."""
    if rec.key is not None and rec.key.decode("utf-8", "replace") == ident:
        return True
    return datum is not None and any(datum.get(f) == ident for f in ID_FIELDS)
