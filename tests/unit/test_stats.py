"""Run statistics are data the reports are built from: hand-worked steps give the expected τ,
acceptance per depth, origins and phase times."""
from specstack.engine.stats import RunStats, StepStats
from specstack.tree import DraftTree
from specstack.verify import VerifyResult


def test_run_stats_from_hand_worked_steps():
    tree = DraftTree([5, 6, 7], [-1, 0, 1], ["draft", "draft2", "context"])
    stats = RunStats(prompt_tokens=4)
    for accepted, taken in (([0, 1, 2], 4), ([0], 2), ([], 1), ([0, 1], 2)):
        step = StepStats(draft_seconds=0.5, target_seconds=1.0)
        step.record(tree, VerifyResult(accepted, [tree.tokens[i] for i in accepted] + [9]), taken)
        stats.add_step(step)
    stats.new_tokens = 4 + 2 + 1 + 2
    assert stats.target_forwards == 4
    assert stats.tau == 9 / 4
    assert [s.accepted for s in stats.steps] == [3, 1, 0, 2]  # each step's accepted path, as verified
    # the last step was cut by a stop after 2 tokens: its target token is not counted
    assert stats.origins == {"draft": 3, "draft2": 2, "context": 1, "target": 3}
    assert stats.phase_seconds() == {"draft": 2.0, "target": 4.0, "verify": 0.0, "overhead": 0.0}
