"""bench/README.md's section on the control plane (bench/control_plane.py), before and after the event store."""

from __future__ import annotations

READER_NAMES = {
    "rank_start": "a rank's start", "rank0_start": "rank 0's start", "recovery_record": "the recovery record",
    "budget_check": "the budget check", "forwarder_pass": "a forwarder pass (10 k new records)",
    "forwarder_restart": "a forwarder restart", "console_poll": "a console poll",
    "end_report": "the end-of-training report", "finalize": "finalize",
}
RATIO_LIMIT = 1.2


def _cell(r: dict | None) -> str:
    if r is None:
        return "n/a"
    return (f"{r['seconds']:.3g} s · {r['files_opened']:,} files · {r['bytes_read'] / 1e6:,.3g} MB read · "
            f"{r['peak_rss_mb']:,.0f} MB RSS")


def _shape(results: dict | None, ranks: int, days: float) -> dict | None:
    return next((s for s in (results or {}).get("shapes", []) if s["ranks"] == ranks and s["days"] == days), None)


def _goal(reader: str, r: dict, goals: dict, rss_goal: float) -> str:
    goal = goals.get(reader)
    if goal is None:
        return "—"
    seconds, files = goal["seconds"], goal["files"]
    met = r["seconds"] <= seconds and (files is None or r["files_opened"] <= files)
    if reader == "end_report":
        met = met and r["peak_rss_mb"] <= rss_goal
    text = f"≤ {seconds:g} s" + (f", ≤ {files} files" if files else "") + (f", ≤ {rss_goal:g} MB" if reader ==
                                                                             "end_report" else "")
    return f"{text}: {'met' if met else '**missed**'}"


def control_plane_section(after: dict, before: dict | None) -> list[str]:
    goals, rss_goal = after["goals"], after["end_report_peak_rss_mb_goal"]
    lines = ["## The control plane at scale — `bench/control_plane.py`", "",
             "```bash", ".venv/bin/python bench/control_plane.py   # ~15 min on 2 cores", "```", "",
             "Every reader of the run folder's history, measured where it runs, on a month of synthetic history "
             "written by the project's own writers: a step every 4 s, FSx saves at the planner's interval for the "
             "shape's nodes (8 ranks a node), faults at the planner's 1,024-node rate (one every 6.2 h); each fault "
             "leaves a failure record from every other rank, then a restart. Each reader runs in a fresh process "
             f"(the fastest of {after.get('repeats', 1)}: noise only adds): wall seconds, files opened, bytes read (rchar), peak RSS "
             "(VmHWM). *Before* is the release before the event store (one events file per rank, every reader "
             f"parsing all of them), measured in a checkout of commit {(before or {}).get('measured_at_commit', '?')} "
             "by a script that imported that release's readers (bench/legacy/control_plane_before.py until issue 51 "
             "removed it, since it runs nowhere else: `git show dc677a9:bench/legacy/control_plane_before.py`); its "
             "result is bench/results/control_plane_before.json. Its 8,192 x 30 row is extrapolated from the measured "
             "1,024 x 30 one (x records, files x 8): 13 GB of that history does not fit two cores' patience.", ""]
    rows = []
    for reader, name in READER_NAMES.items():
        for ranks, days in ((1024, 30.0), (8192, 30.0)):
            old, new = _shape(before, ranks, days), _shape(after, ranks, days)
            label = f"{ranks:,} x {days:g} d" + (" (extrapolated)" if old and old.get("extrapolated_from") else "")
            rows.append([name, label, _cell(old["readers"][reader] if old else None),
                         _cell(new["readers"][reader] if new else None),
                         _goal(reader, new["readers"][reader], goals, rss_goal) if new and ranks == 8192 else ""])
    lines += _table(["reader", "shape", "before", "after", "goal at 8,192 x 30"], rows)
    long, short = _shape(after, 8192, 30.0), _shape(after, 8192, 1.0)
    if long and short:
        lines += ["Growth with the history's length, 8,192 ranks, 30 days over 1 day (goal: at most "
                  f"{RATIO_LIMIT:g} for every reader but the end report):", ""]
        ratio_rows = []
        for reader, name in READER_NAMES.items():
            a, b = long["readers"][reader], short["readers"][reader]
            ratios = {k: a[k] / b[k] if b[k] else (1.0 if a[k] == b[k] else float("inf"))
                      for k in ("seconds", "files_opened", "bytes_read", "peak_rss_mb")}
            verdict = "exempt" if reader == "end_report" else (
                "met" if max(ratios.values()) <= RATIO_LIMIT else "**missed**")
            ratio_rows.append([name, *(f"{ratios[k]:.2f}" for k in ratios), verdict])
        lines += _table(["reader", "seconds", "files", "bytes", "peak RSS", "≤ 1.2"], ratio_rows)
    lines += ["All shapes measured (after):", ""]
    shapes = after["shapes"]
    lines += _table(["reader", *(f"{s['ranks']:,} x {s['days']:g} d" for s in shapes)],
                    [[name, *(f"{s['readers'][r]['seconds']:.3g} s, {s['readers'][r]['files_opened']} files"
                              for s in shapes)] for r, name in READER_NAMES.items()])
    lines += _table(["history", *(f"{s['ranks']:,} x {s['days']:g} d" for s in shapes)],
                    [["records (events)", *(f"{s['records']:,}" for s in shapes)],
                     ["metrics lines", *(f"{s['metrics_lines']:,}" for s in shapes)],
                     ["saves / faults", *(f"{s['saves']:,} / {s['faults']}" for s in shapes)],
                     ["run folder", *(f"{s['bytes'] / 1e6:,.0f} MB" for s in shapes)]])
    return lines


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows),
            ""]
