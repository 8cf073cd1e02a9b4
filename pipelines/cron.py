"""KFP's cron: 6 fields, seconds first (robfig/cron, which KFP's scheduled workflows use), evaluated in UTC."""

from __future__ import annotations

import re

_CRON_FIELDS = [("second", 0, 59), ("minute", 0, 59), ("hour", 0, 23), ("day of month", 1, 31), ("month", 1, 12),
                ("day of week", 0, 6)]
_NAMES = {4: ["JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"],
          5: ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"]}
_DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")


class CronError(ValueError):
    """A cron expression KFP would refuse or read differently; the message names the field."""


def validate_cron(expression: str) -> str:
    """KFP's 6-field cron (seconds first) or a robfig descriptor; raises CronError naming the bad field."""
    expression = expression.strip()
    if expression in _DESCRIPTORS or re.fullmatch(r"@every \d+(ns|us|ms|s|m|h)(\d+(ns|us|ms|s|m|h))*", expression):
        return expression
    fields = expression.split()
    if len(fields) != 6:
        raise CronError(f"--cron {expression!r}: KFP takes 6 fields, seconds first "
                          f"(second minute hour day-of-month month day-of-week, e.g. '0 0 2 * * *'); got {len(fields)}")
    for index, (field, (name, low, high)) in enumerate(zip(fields, _CRON_FIELDS)):
        if field == "?" and index in (3, 5):
            continue
        for part in field.split(","):
            base, _, step = part.partition("/")
            if step and not (step.isdigit() and int(step) > 0):
                raise CronError(f"--cron {expression!r}: {name} step {step!r} must be a positive number")
            if base == "*":
                continue
            bounds = base.split("-")
            if len(bounds) > 2 or not all(bounds):
                raise CronError(f"--cron {expression!r}: {name} field {part!r} is not a value, range or */step")
            for bound in bounds:
                value = _NAMES.get(index, []).index(bound.upper()) + (1 if index == 4 else 0) \
                    if bound.upper() in _NAMES.get(index, []) else (int(bound) if bound.isdigit() else None)
                if value is None or not low <= value <= high:
                    raise CronError(f"--cron {expression!r}: {name} {bound!r} is outside {low}-{high}")
    return expression
