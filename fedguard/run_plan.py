"""A run plan: a validated configuration in the one text form that the processes of its run rebuild it from.

``fedguard run`` validates its configuration once, in the process it was typed in, and hands the plan to the
ServerApp and every ClientApp in Flower's run config under ``PLAN_KEY``; they rebuild the configuration from
it (``fedguard.config.Config.from_plan``) without checking it again. The text is JSON: the keys that shape the
run and a SHA-256 digest of them, so that a plan cut short or edited on its way is refused, not half-read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

PLAN_KEY = "run-plan"
"""The run-config key (declared in ``pyproject.toml``, empty by default) that carries the plan."""


class PlanError(ValueError):
    """A plan that is not one ``plan_text`` wrote: not JSON, a missing part, or keys that do not match their
    digest."""


def _digest(keys: Mapping[str, Any]) -> str:
    canonical = json.dumps(dict(keys), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def plan_text(keys: Mapping[str, Any]) -> str:
    """The plan of ``keys`` (flat keys of a validated configuration, scalar values) as one line of JSON."""
    return json.dumps({"keys": dict(keys), "sha256": _digest(keys)}, sort_keys=True, allow_nan=False)


def plan_keys(text: str) -> dict[str, Any]:
    """The keys of the plan ``text``; ``PlanError`` saying what is wrong with it."""
    try:
        plan = json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanError(f"{PLAN_KEY} is not a run plan ({error}); a plan is the JSON `fedguard run` writes") from None
    if not isinstance(plan, dict) or not isinstance(plan.get("keys"), dict) or not isinstance(plan.get("sha256"), str):
        raise PlanError(
            f"{PLAN_KEY} holds no 'keys' table and 'sha256' digest; a plan is the JSON `fedguard run` writes"
        )
    keys: dict[str, Any] = plan["keys"]
    if _digest(keys) != plan["sha256"]:
        raise PlanError(f"{PLAN_KEY}: its keys do not match their sha256 digest (the plan was changed on its way)")
    return keys
