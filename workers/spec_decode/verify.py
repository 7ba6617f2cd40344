"""The acceptance rule: keep the longest run of drafts that equal the target's own picks, then one more pick.

`picks[j]` is the token the target model picks (greedy: its argmax; sampled: its usual draw for that token
index) at the position after the request's last token and its first j drafts. Draft j + 1 is accepted
when it equals picks[j] and every draft before it was accepted; the request then takes picks[0..a], where
a is the number of drafts accepted: the accepted drafts, and the target's own pick after them (where it
disagreed with the next draft, or after the last one). This yields exactly the tokens that decoding one
at a time would, token for token for greedy requests.

For a sampled request this is rejection sampling for a deterministic draft: draft x is accepted with
probability p(x), and on rejection the pick is distributed as p with x removed. Drawing each pick with the
request's seeded generator for its token index keeps seeded output equal to non-speculative output.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

Failure = TypeVar("Failure", bound=BaseException)


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # what the request takes this step, in order: the accepted drafts then one pick
    num_accepted: int  # drafts accepted: len(tokens) - 1


def verify(drafts: Sequence[int], picks: Sequence[int | Failure]) -> Verdict | Failure:
    """The verdict on `drafts` given the target's `picks` (one more than drafts); a pick that failed
    (a non-finite row, a sampler that raised) fails the request only if the verdict needs that pick."""
    if len(picks) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} picks, not {len(picks)}")
    accepted = 0
    while accepted < len(drafts) and picks[accepted] == drafts[accepted]:
        accepted += 1
    last = picks[accepted]
    if isinstance(last, BaseException):
        return last
    return Verdict([*drafts[:accepted], last], accepted)
