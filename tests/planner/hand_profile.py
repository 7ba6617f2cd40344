"""The planner tests' profile, `hand_profile.json`: written by hand, shaped as measured profiles are (prefill
cost linear in the step's tokens, a decode step nearly flat in its batch and growing with context, a prompt
chunk dearer the later it starts in its prompt)."""

import json
from pathlib import Path

from planner.profile import CostProfile

HAND_PROFILE = Path(__file__).with_name("hand_profile.json")


def hand_profile(**changes) -> CostProfile:
    """The profile of hand_profile.json, with top-level fields changed."""
    return CostProfile.from_json({**json.loads(HAND_PROFILE.read_text()), **changes})
