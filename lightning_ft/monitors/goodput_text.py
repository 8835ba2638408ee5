"""The goodput report as text for a terminal: :func:`format_report` of
:func:`~lightning_ft.monitors.goodput_report.summarize`'s result, as ``lightning-ft report`` prints it.

Only formatting: every number comes from the summary (its definitions are in
:mod:`~lightning_ft.monitors.goodput_report`, :mod:`~lightning_ft.monitors.checkpoint_tiers` and
:mod:`~lightning_ft.monitors.goodput_projection`). A summary of a log without checkpoint tiers prints the lines
lightning-ft 0.2.0 printed, plus the tier block.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from lightning_ft.monitors.run_history import num

__all__ = ["fmt_ratio", "format_report"]


def _fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 3600:
        return f"{value / 3600:.1f}h"
    return f"{value:.1f}s"


def _fmt_cost(value: float | None) -> str:
    """Seconds with two decimals below one second (a memory-tier stall is a fraction of one)."""
    return f"{value:.2f}s" if value is not None and abs(value) < 1 else _fmt_s(value)


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


_END_TEXT = {
    "killed": "killed (no end recorded)",
    "unknown": "no end recorded (still running, or killed)",
}


def format_report(summary: dict[str, Any]) -> str:
    """A plain-text report of :func:`summarize`'s result, for a terminal."""
    t = summary["totals"]
    memory_in_use = bool(summary.get("tiers", {}).get("memory_in_use"))
    lines = [
        f"run {summary['run_id']}: {t['attempts']} attempt(s), {t['restarts']} restart(s)"
        + (f", {t['continuations']} continuation(s)" if t.get("continuations") else ""),
        f"  effective training time ratio  {fmt_ratio(summary['ettr'])}"
        f"  (useful productive {_fmt_s(t['useful_productive_s'])} of {_fmt_s(t['wall_s'])} wall)",
        *_startup_note(t),
        f"  device utilisation             {fmt_ratio(summary['device_utilisation'])}"
        f"  ({t['device_s_held']:.1f} device-s held, gaps before restarts included)",
        f"  productive {_fmt_s(t['productive_s'])}, data wait {_fmt_s(t['data_wait_s'])}, "
        f"checkpoint stalls {_fmt_s(t['checkpoint_stall_s'])}, restarts {_fmt_s(t['restart_s'])}, "
        f"lost work {t['lost_steps']} steps / {_fmt_s(t['lost_s'])}, stragglers {_fmt_s(t['straggler_s'])}",
    ]
    ended_by: dict[int, str] = {}
    for a in summary["attempts"]:
        ended = _END_TEXT.get(a["end_reason"], a["end_reason"])
        if a.get("signal"):
            ended += f" ({a['signal']})"
        if a.get("killed_ranks"):
            ranks = ", ".join(map(str, a["killed_ranks"]))
            ended = f"killed: rank {ranks} recorded no end; the others recorded {a.get('recorded_reason')}"
            if a.get("signal"):
                ended += f" ({a['signal']})"
        if a["last_step"] is None:
            steps = "no step trained" + (
                f" (resumed at step {a['start_step']})" if a["resumed_step"] is not None else ""
            )
        else:
            steps = f"steps {a['start_step']}..{a['last_step']}"
        ended_by[a["attempt"]] = (
            f"killed: rank {', '.join(map(str, a['killed_ranks']))} recorded no end"
            if a.get("killed_ranks")
            else _END_TEXT.get(a["end_reason"], a["end_reason"])
        )
        memory = f" + {a['memory_checkpoints']} in memory" if a.get("memory_checkpoints") else ""
        estimated = ""
        if a.get("estimated_steps"):
            estimated = (
                f" ({_fmt_s(a['estimated_productive_s'])} of it estimated:"
                f" {a['estimated_steps']} step(s) after its last progress line)"
            )
        lines.append(
            f"  attempt {a['attempt']}: world size {a['world_size']}, wall {_fmt_s(a['wall_s'])}, {steps}, "
            f"productive {_fmt_s(a['productive_s'])}{estimated}, {a['checkpoints']} checkpoint(s){memory}, "
            f"ended: {ended}"
        )
    for c in summary.get("continuations", []):
        lines.append(
            f"  attempt {c['attempt']} continues finished attempt {c['after_attempt']}: "
            f"gap {_fmt_s(c['gap_s'])} (not the run's time), start-up {_fmt_s(c['startup_s'])}"
        )
    for r in summary["restarts"]:
        phases = ", ".join(
            f"{name} {_fmt_s(r[key])}"
            for name, key in (
                ("detection" if r["exit_s"] is not None else "detection, exit and relaunch", "detection_s"),
                ("exit", "exit_s"),
                ("relaunch", "relaunch_s"),
                ("start-up", "startup_s"),
                ("load", "load_s"),
                ("first step", "first_step_s"),
            )
            if r[key] is not None
        )
        lines.append(
            f"  restart before attempt {r['attempt']} (after: {ended_by.get(r['after_attempt'], r['cause'])}): "
            f"{_fmt_s(r['restart_s'])} = {phases}; "
            + (
                f"healed at step {r['resumed_step']} from a live replica group"
                if r.get("healed")
                else f"resumed at step {r['resumed_step']}"
                + (f" from the {r['resumed_tier'] or 'no'} tier" if memory_in_use else "")
            )
            + ", "
            f"recomputed {r['lost_steps']} steps ({_fmt_s(r['lost_s'])})"
            + (
                f", world size {r['world_size_before']} -> {r['world_size']}"
                if r["world_size_before"] != r["world_size"]
                else ""
            )
        )
    lines.append(_format_interval(summary["checkpoint_interval"]))
    intervals = summary.get("checkpoint_intervals", {})
    if intervals.get("memory") is not None:
        lines.append(_format_interval(intervals["memory"]))
    if "tiers" in summary:
        lines += _format_tiers(summary["tiers"])
    if summary.get("projection") is not None:
        lines += _format_projection(summary["projection"])
    s = summary["stragglers"]
    latencies = [d["latency_steps"] for d in s["detections"] if d["latency_steps"] is not None]
    lines.append(
        f"  straggler detections: {s['count']}"
        + (f", onset to detection {min(latencies)}..{max(latencies)} steps" if latencies else "")
    )
    for d in s["detections"]:
        ratio = f"{d['ratio']:.2f}x" if isinstance(d["ratio"], (int, float)) else "?"
        lines.append(f"    step {d['step']}: rank {d['suspect_rank']} {ratio} (onset step {d['onset_step']})")
    if summary.get("replicas") is not None:
        lines += _format_replicas(summary["replicas"])
    counts = Counter(i["event"] for i in summary["incidents"])
    if counts:
        lines.append("  incidents: " + ", ".join(f"{n} {name}" for name, n in sorted(counts.items())))
    t0 = min((a["start_time"] for a in summary["attempts"]), default=0.0)
    lines += [_format_node_incident(i, t0) for i in summary["incidents"] if i["event"] in _NODE_INCIDENTS]
    return "\n".join(lines)


STARTUP_DOMINATES = 0.5
"""The share of the wall time above which the report says that start-up dominates the run."""


def _startup_note(t: dict[str, Any]) -> list[str]:
    """A line when start-up (process start to the first step, restarts left out) is most of the wall time: the ETTR of
    a short run measures its start-up, not its training."""
    startup, wall = num(t.get("startup_s")), num(t.get("wall_s"))
    if wall <= 0 or startup <= STARTUP_DOMINATES * wall:
        return []
    after = wall - startup
    rest = fmt_ratio(t["useful_productive_s"] / after) if after > 0 else "-"
    return [
        f"  start-up dominates: {_fmt_s(startup)} of the {_fmt_s(wall)} wall ({fmt_ratio(startup / wall)}) ran from"
        " process start to the first step (imports, process group, model set-up, checkpoint load), which a longer"
        f" run spreads over more steps; after start-up the ratio is {rest}"
    ]


_NODE_INCIDENTS = frozenset({"node_evicted", "join_refused"})


def _ranks(ranks: Any) -> str:
    if not isinstance(ranks, list) or not ranks:
        return "ranks ?"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _format_node_incident(i: dict[str, Any], t0: float) -> str:
    at = f"attempt {i['attempt']}, {_fmt_s(num(i['time']) - t0)} into the run"
    if i["event"] == "node_evicted":
        cooldown = f"; cooldown {_fmt_s(num(i['cooldown_s']))}" if i.get("cooldown_s") is not None else ""
        return (
            f"    node evicted: host {i['host']} ({_ranks(i.get('ranks'))}), {at}, source {i['source']}: "
            f"{i['reason']}{cooldown}"
        )
    until = i.get("until")
    left = f"; refused until {_fmt_s(max(num(until) - num(i['time']), 0.0))} later" if until is not None else ""
    code = f" (exit code {i['exit_code']})" if i.get("exit_code") is not None else ""
    return f"    join refused: host {i['host']} ({_ranks(i.get('ranks'))}), {at}: {i['reason']}{left}{code}"


def _fmt_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def _format_saves(tier: str, sv: dict[str, Any]) -> str:
    if not sv["count"] and not sv["failed"]:
        return f"    {tier} saves: none"
    size = _fmt_bytes(sv["size_bytes"]) + (f" + {_fmt_bytes(sv['peer_bytes'])} peer" if sv["peer_bytes"] else "")
    failed = ""
    if sv["failed"]:
        failed = f", {sv['failed']} failed (" + ", ".join(f"{r}: {n}" for r, n in sv["failed_reasons"].items()) + ")"
    return (
        f"    {tier} saves: {sv['count']}, stall {_fmt_cost(sv['stall_s'])} median ({_fmt_cost(sv['total_s'])} in all), "
        f"{size} on rank 0{failed}"
    )


def _format_restores(tier: str, rs: dict[str, Any]) -> str:
    name = "no checkpoint" if tier == "none" else f"from {tier}"
    text = f"    restores {name}: {rs['attempts']}"
    if rs["load_s"] is not None:
        text += f", load {_fmt_cost(rs['load_s'])} median"
    if rs["restored_from"] and tier != "durable":
        text += " (ranks: " + ", ".join(f"{n} {t}" for t, n in sorted(rs["restored_from"].items())) + ")"
    if rs["failures"]:
        text += (
            f"; {rs['lost_steps_per_failure']:.1f} steps lost per failure ({rs['failures']} failure(s): "
            + ", ".join(map(str, rs["lost_steps"]))
            + ")"
        )
    return text


def _format_tiers(tiers: dict[str, Any]) -> list[str]:
    lines = ["  checkpoint tiers:"]
    for tier, sv in tiers["saves"].items():
        if tier == "memory" and not tiers["memory_in_use"]:
            lines.append('    memory tier: not in use (no save, failed save or resume names tier "memory")')
            continue
        lines.append(_format_saves(tier, sv))
    for tier, rs in tiers["restores"].items():
        if rs["attempts"] or rs["failures"]:
            lines.append(_format_restores(tier, rs))
    observed = tiers.get("observed_durable_fraction")
    if observed is not None:
        lines.append(
            f"    failures that resumed from the durable tier (or from nothing): {observed['durable']} of"
            f" {observed['failures']}; the intervals use {_fmt_pct(tiers['durable_fraction'])}"
            f" ({tiers['durable_fraction_source']}, --durable-fraction)"
        )
    rejected = [f"{n} {tier}" for tier, n in tiers["rejected"].items() if n]
    lines.append("    rejected checkpoints: " + (", ".join(rejected) if rejected else "none"))
    return lines


def _fmt_pct(value: float) -> str:
    return f"{100 * value:.2f}%"


_PART_NAMES = {"rendezvous_s": "rendezvous", "startup_s": "start-up", "load_s": "load", "first_step_s": "first step"}


def _format_projection(p: dict[str, Any]) -> list[str]:
    points = ", ".join(f"{_fmt_s(h * 3600)} at {n}" for n, h in p["mttf_points_hours"].items())
    lines = [
        "  goodput projection (first-order model: ETTR = 1 - save - lost work - restart, optimal intervals;"
        " docs/monitors.md):",
        f"    MTTF {points} GPUs ({p['mttf_source']}); between and beyond the points: straight lines on log-log axes",
    ]
    if p["note"] is not None:
        return [*lines, f"    {p['note']}"]

    def costs(name: str, c: dict[str, Any]) -> str:
        parts = ", ".join(f"{_PART_NAMES[part]} {_fmt_cost(v)}" for part, v in c["parts"].items() if v is not None)
        text = f"{name} save {_fmt_cost(c['stall_s'])}, restart {_fmt_cost(c['restart_s'])}" + (
            f" ({parts})" if parts else ""
        )
        if c["not_measured"] and not c.get("restart_assumed"):
            text += "; not measured, counted as 0: " + ", ".join(c["not_measured"])
        return text

    lines.append("    costs measured in this run: " + costs("durable", p["durable"]))
    if p["memory"] is not None:
        lines.append(
            "    " + costs("memory", p["memory"]) + f"; failures that need the durable tier: "
            f"{_fmt_pct(p['durable_fraction'])} ({p['durable_fraction_source']})"
        )
    if p["memory_note"] is not None:
        lines.append(f"    with the memory tier: {p['memory_note']}")
    for row in p["rows"]:
        without = row["without"]
        text = (
            f"    {row['gpus']} GPUs (MTTF {_fmt_s(row['mttf_s'])}, {row['mttf_how']}): without the memory tier "
            f"{_fmt_pct(without['ettr'])} (durable every {_fmt_s(without['interval_s']['durable'])})"
        )
        if row["with"] is not None:
            every = ", ".join(
                f"{tier} every {_fmt_s(v)}" for tier, v in row["with"]["interval_s"].items() if v is not None
            )
            text += f"; with it {_fmt_pct(row['with']['ettr'])} ({every})"
        lines.append(text)
    return lines


def _format_interval(ci: dict[str, Any]) -> str:
    tier = "checkpoint" if ci.get("tier", "durable") == "durable" else f"{ci['tier']}-tier"
    share = ci.get("failure_share", 1.0)
    if ci["stall_s"] is None:
        return f"  {tier} interval: no committed checkpoint recorded, no suggestion"
    fmt = _fmt_s if tier == "checkpoint" else _fmt_cost  # the durable line reads as in 0.2.0
    cost = f"checkpoint cost to the loop {fmt(ci['stall_s'])} (median; {fmt(ci['total_s'])} in all)"
    if ci["mtbf_source"] == "observed":
        mtbf = f"MTBF {_fmt_s(ci['mtbf_s'])} observed ({ci['failures']} failure(s))"
    elif ci["mtbf_source"] == "given":
        mtbf = f"MTBF {_fmt_s(ci['mtbf_s'])} given" + (
            f" (observed: {_fmt_s(ci['observed_mtbf_s'])})" if ci["observed_mtbf_s"] is not None else ""
        )
    else:
        mtbf = f"no failure observed; MTBF assumed {_fmt_s(ci['mtbf_s'])} (--mtbf-hours to change)"
    if share != 1.0:
        mtbf += f"; {_fmt_pct(share)} of failures resume from this tier (--durable-fraction), MTBF for it " + (
            _fmt_s(ci["tier_mtbf_s"]) if ci["tier_mtbf_s"] is not None else "none"
        )
    if ci["interval_s"] is None:
        why = "no failure resumes from this tier" if share == 0 else "checkpoints did not block the loop"
        return f"  {tier} interval: {cost}, {mtbf}; {why}, no suggestion"
    steps = f" = every ~{ci['interval_steps']} steps" if ci["interval_steps"] is not None else ""
    now = f" (now every {ci['current_interval_steps']:g})" if ci["current_interval_steps"] is not None else ""
    return (
        f"  {tier} interval (Young-Daly sqrt(2 x cost x MTBF)): {_fmt_s(ci['interval_s'])}{steps}{now}; {cost}, {mtbf}"
    )


def _format_replicas(r: dict[str, Any]) -> list[str]:
    """The replica mode: groups lost (the survivors' stall), joined and healed, and the live groups over the run."""
    live = " -> ".join(str(n) for _, n in r["live_groups"])
    lines = [
        f"  replica groups: {r['replicas_lost']} lost (survivors stalled {_fmt_cost(r['stall_s'])},"
        f" {r['discarded_steps']} discarded step(s)), {r['replicas_joined']} joined, {len(r['heals'])} healed"
        f" ({_fmt_cost(r['heal_s'])}, {_fmt_bytes(r['heal_bytes'])} from live peers)"
        + (f"; live groups {live} (fewest {r['min_live_groups']})" if live else "")
    ]
    records = (
        [(x, "lost") for x in r["lost"]] + [(x, "joined") for x in r["joined"]] + [(x, "healed") for x in r["heals"]]
    )
    for x, kind in sorted(records, key=lambda xk: (num(xk[0]["step"], -1), num(xk[0]["time"]))):
        text = f"    step {x['step']}: group {x['replica_id']} {kind}"
        if kind == "lost":
            text += f", survivors stalled {_fmt_cost(x['stall_s'])}, {x['discarded_steps']} discarded step(s)"
        elif kind == "healed":
            text += f" from group {x['source']}: {_fmt_bytes(x['bytes'])} in {_fmt_cost(x['seconds'])}"
        lines.append(text)
    outages, gone = r.get("lighthouse_outages", []), r.get("lighthouse_lost", [])
    if outages or gone:
        lines.append(
            f"  lighthouse: {len(outages)} outage(s) lived through (down {_fmt_cost(r['lighthouse_down_s'])}, the"
            f" quorums waited {_fmt_cost(r['lighthouse_stall_s'])}, counted in data wait)"
            + (f"; gone for good {len(gone)} time(s)" if gone else "")
        )
    for x in sorted(outages + gone, key=lambda x: num(x["time"])):
        if "waited_s" in x:
            saved = f", committed {x['checkpoint_path']}" if x["checkpoint_path"] else ""
            lines.append(
                f"    step {x['step']}: lighthouse did not answer for {_fmt_cost(x['waited_s'])}: stopped{saved}"
            )
        else:
            lines.append(
                f"    step {x['step']}: lighthouse down {_fmt_cost(x['down_s'])}, the quorum waited"
                f" {_fmt_cost(x['stall_s'])}"
            )
    return lines
