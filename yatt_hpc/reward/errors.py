"""The reward's user errors: one class, so a rank prints it as one message and the run stops (exit 2).

    raise RewardError("reward.terms[2] (mine): pkg.mod:fn raised on sample 17 ...; fix the function")

Raised for what the config names and the user must fix: a reward function that cannot be imported, that
raises or returns no number for a row, a judge template file that is missing or holds no `{response}`, a
judge without the chat template `reward.judge_chat=true` asks for. Registered in `yatt_hpc/errors.py`.
"""
from __future__ import annotations


class RewardError(ValueError):
    """A reward setting or reward function the user has to fix; the message names the term, the row and the fix."""
