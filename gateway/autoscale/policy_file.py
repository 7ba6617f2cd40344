"""The scaling policy as a JSON file (the gateway's --autoscale-policy). Every key is optional:

    {"targets": {"queue_per_worker": 4, "pending_tokens_per_worker": 8192, "kv_utilisation": 0.8,
                 "running_share": 0.9, "attainment_floor": 0.9, "low_share": 0.5},
     "defaults": {"min_replicas": 1, "max_replicas": 16, "max_running": 64},
     "scale_down_window_s": 300, "max_step_up": 4, "max_step_down": 1,
     "fleets": [{"model": "diptych-tiny", "role": "prefill", "region": "us-east-1",
                 "baseline": 2, "min_replicas": 1, "max_replicas": 8, "max_running": 64}]}

`fleets[].baseline` is the planner's recommendation for that fleet: the fleet never scales below it. A fleet
not listed takes `defaults`. The baselines may instead come straight from `diptych plan --json`:

     "plans": [{"model": "diptych-tiny", "region": "us-east-1", "plan": <what diptych plan --json printed>}]

gives the prefill and decode fleets of that model and region the counts of the plan's split fleet (or the
colocated fleet its count of the colocated one, when colocated won); the keys of a `fleets` entry for the
same fleet take precedence. Unknown keys and bad values are refused with a message naming them.
"""

import dataclasses
import json
from pathlib import Path
from typing import Any

from gateway.autoscale.decision import ROLES, FleetKey, FleetLimits, ScalingPolicy, Targets

_TOP_LEVEL = {"targets", "defaults", "fleets", "plans", "scale_down_window_s", "max_step_up", "max_step_down"}
_LIMITS = {f.name for f in dataclasses.fields(FleetLimits)}
_TARGETS = {f.name for f in dataclasses.fields(Targets)}


class PolicyError(ValueError):
    pass


def load_policy(path: Path) -> ScalingPolicy:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise PolicyError(f"cannot read the autoscale policy {path}: {error}") from None
    return policy_from_json(data, str(path))


def policy_from_json(data: object, where: str = "the autoscale policy") -> ScalingPolicy:
    if not isinstance(data, dict):
        raise PolicyError(f"{where} must be a JSON object")
    _refuse_unknown(data, _TOP_LEVEL, where)
    try:
        targets = Targets(**_numbers(data.get("targets", {}), _TARGETS, f"{where}: targets"))
        defaults = _defaults(data.get("defaults", {}), f"{where}: defaults")
        fleets = {
            key: dataclasses.replace(defaults, baseline=baseline)
            for i, entry in enumerate(_list(data, "plans", where))
            for key, baseline in _planned_baselines(entry, f"{where}: plans[{i}]").items()
        }
        for i, entry in enumerate(_list(data, "fleets", where)):
            key, limits = _fleet(entry, fleets, defaults, f"{where}: fleets[{i}]")
            fleets[key] = limits
        return ScalingPolicy(
            targets=targets,
            defaults=defaults,
            fleets=fleets,
            scale_down_window_s=float(data.get("scale_down_window_s", 300.0)),
            max_step_up=int(data.get("max_step_up", 4)),
            max_step_down=int(data.get("max_step_down", 1)),
        )
    except (TypeError, ValueError) as error:
        if isinstance(error, PolicyError):
            raise
        raise PolicyError(f"{where}: {error}") from None


def _planned_baselines(entry: object, where: str) -> dict[FleetKey, int]:
    """The baselines of one model and region from `diptych plan --json`: its winning mode's worker counts."""
    if (
        not isinstance(entry, dict)
        or set(entry) - {"model", "region", "plan"}
        or not isinstance(entry.get("model"), str)
    ):
        raise PolicyError(f"{where} must be an object with a model, a region and the plan")
    plan = entry.get("plan")
    mode = plan.get("winner") if isinstance(plan, dict) else None
    mode = "split" if mode == "tie" else mode
    fleet = plan.get(mode) if isinstance(plan, dict) and mode in ("split", "colocated") else None
    if not isinstance(fleet, dict):
        raise PolicyError(
            f"{where}: the plan found no fleet (its winner is {mode!r}); give baselines in fleets instead"
        )
    roles = ("prefill", "decode") if mode == "split" else ("colocated",)
    counts = {role: fleet.get(role) for role in roles}
    if not all(isinstance(count, int) and count >= 0 for count in counts.values()):
        raise PolicyError(f"{where}: the plan's {mode} fleet needs whole worker counts, not {counts}")
    region = str(entry.get("region", ""))
    return {FleetKey(entry["model"], role, region): int(count or 0) for role, count in counts.items()}


def _list(data: dict[str, Any], name: str, where: str) -> list[Any]:
    values = data.get(name, [])
    if not isinstance(values, list):
        raise PolicyError(f"{where}: {name} must be a list")
    return values


def _defaults(values: object, where: str) -> FleetLimits:
    allowed = _LIMITS - {"baseline"}  # a baseline is the planner's, per fleet
    if not isinstance(values, dict):
        raise PolicyError(f"{where} must be an object")
    _refuse_unknown(values, allowed, where)
    return FleetLimits(**_integers(values, allowed, where))


def _fleet(
    entry: object, planned: dict[FleetKey, FleetLimits], defaults: FleetLimits, where: str
) -> tuple[FleetKey, FleetLimits]:
    """A fleets entry: its keys over the plan's limits for that fleet, or over the defaults."""
    if not isinstance(entry, dict):
        raise PolicyError(f"{where} must be an object")
    _refuse_unknown(entry, _LIMITS | {"model", "role", "region"}, where)
    if not isinstance(entry.get("model"), str) or entry.get("role") not in ROLES:
        raise PolicyError(f"{where} needs a model and a role of {', '.join(ROLES)}")
    key = FleetKey(entry["model"], entry["role"], str(entry.get("region", "")))
    limits = dataclasses.replace(planned.get(key, defaults), **_integers(entry, _LIMITS, where))
    return key, limits


def _numbers(values: object, allowed: set[str], where: str) -> dict[str, float]:
    if not isinstance(values, dict):
        raise PolicyError(f"{where} must be an object")
    _refuse_unknown(values, allowed, where)
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise PolicyError(f"{where}.{name} must be a number, not {value!r}")
    return {name: float(value) for name, value in values.items()}


def _integers(values: object, allowed: set[str], where: str) -> dict[str, int]:
    """The whole-number entries of `values` named in `allowed` (the caller refuses unknown keys)."""
    if not isinstance(values, dict):
        raise PolicyError(f"{where} must be an object")
    picked = {name: value for name, value in values.items() if name in allowed}
    for name, value in picked.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise PolicyError(f"{where}.{name} must be a whole number, not {value!r}")
    return picked


def _refuse_unknown(values: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise PolicyError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(allowed))}")
