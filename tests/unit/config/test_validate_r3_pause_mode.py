"""``megarl validate`` refuses R3 with a pause mode that cannot keep sampling-time routes (issue 28).

A weight sync in async mode interrupts requests in flight; R3 must replay, for every position, the
route of the engine forward that sampled the next token. SGLang 0.5.23 keeps those only when the
pause aborts the requests (``abort``); ``retract`` reports the re-prefill's routes and ``in_place``
cannot be flushed (the reasons, with SGLang references: ``megarl.config.validate.CONFLICTS``).
Without async mode nothing is in flight during a sync, so every mode is accepted. The reference is
the rule's definition above, stated per combination.
"""
import pytest
from config_issues import validate_issues

KEYS = ("train.routing_replay", "weight_sync.pause_mode", "rollout.async_mode")


CASES = [  # (train.routing_replay, rollout.async_mode, weight_sync.pause_mode, refused)
    ("r3", True, "retract", True), ("r3", True, "in_place", True), ("r3", True, "abort", False),
    ("r3", False, "retract", False), ("r3", False, "in_place", False), ("none", True, "retract", False),
]


@pytest.mark.parametrize("replay, async_mode, pause_mode, refused", CASES)
def test_r3_pause_mode_rule(replay, async_mode, pause_mode, refused):
    issues = validate_issues([f"train.routing_replay={replay}", f"rollout.async_mode={async_mode}",
                              f"weight_sync.pause_mode={pause_mode}"])
    message = issues.get("weight_sync.pause_mode", "")
    assert ("routing_replay" in message) == refused, issues
    if refused:
        assert all(key in message for key in KEYS), message
