"""Evaluation metrics on hand-computed cases: unbiased pass@k, avg@k, accuracy, errors, repeats, task types."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from agentrl.eval.metrics import (
    FAILED_ERROR,
    MISSING,
    SCORE_ERROR,
    Sample,
    TaskSamples,
    pass_at_k,
    pass_ks,
    per_task_rows,
    summarize,
    summarize_by_type,
)
from agentrl.eval.runner import classify


def task(task_id: str, scores: list[float | str], task_type: str = "t") -> TaskSamples:
    """Samples in slot order; a string is an error kind instead of a score."""
    return TaskSamples(task_id, task_type, [
        Sample(slot, error=s, outcome=None) if isinstance(s, str) else Sample(slot, score=s, outcome="answer")
        for slot, s in enumerate(scores)])


def test_pass_at_k_hand_computed() -> None:
    # n = 5 samples, c = 2 correct: 1 - C(3,k)/C(5,k)
    assert pass_at_k(5, 2, 1) == pytest.approx(1 - 3 / 5)  # 0.4 = c/n
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 0.7
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 0.9
    assert pass_at_k(5, 2, 4) == 1.0 and pass_at_k(5, 2, 5) == 1.0  # C(3,4) = C(3,5) = 0
    assert pass_at_k(5, 0, 5) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)


def test_pass_at_k_is_the_probability_over_all_k_subsets() -> None:
    for n, c in ((6, 1), (6, 3), (7, 4), (8, 0)):
        outcomes = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_stays_exact_for_large_n() -> None:
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    assert pass_at_k(1000, 10, 500) == pytest.approx(1 - math.comb(990, 500) / math.comb(1000, 500))
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_pass_ks() -> None:
    assert pass_ks(1) == [1]
    assert pass_ks(5) == [1, 2, 4, 5]
    assert pass_ks(8) == [1, 2, 4, 8]


def test_summary_with_errors_excluded_and_counted() -> None:
    tasks = [
        task("a", [1, 1, 0, 0, 0]),  # n=5, c=2
        task("b", [0, 0, 0, 0, 0]),  # n=5, c=0
        task("c", [1, SCORE_ERROR, 0, FAILED_ERROR, 1]),  # n=3, c=2 (two errors excluded)
        task("d", [MISSING] * 5, task_type="u"),  # only errors: excluded from the task means
    ]
    s = summarize(tasks, k=5)
    assert s["tasks"] == 4 and s["tasks_scored"] == 3 and s["tasks_all_errors"] == 1
    assert s["samples"] == 20 and s["valid_samples"] == 13
    assert s["errors"] == 7 and s["errors_by_kind"] == {FAILED_ERROR: 1, MISSING: 5, SCORE_ERROR: 1}
    assert s["correct"] == 4
    assert s["accuracy"] == pytest.approx(4 / 13)
    assert s["mean_reward"] == pytest.approx(4 / 13)
    assert s["avg@5"] == pytest.approx((2 / 5 + 0 + 2 / 3) / 3)
    assert s["pass@1"] == pytest.approx((0.4 + 0 + 2 / 3) / 3)
    # pass@2: a 0.7, b 0, c 1 - C(1,2)/C(3,2) = 1
    assert s["pass@2"] == pytest.approx((0.7 + 0 + 1) / 3)
    # pass@5: a 1, b 0, c has 3 < 5 valid samples: falls back to pass@3 = 1
    assert s["pass@5"] == pytest.approx(2 / 3)
    assert s["tasks_short_of_k"] == 1
    assert s["outcomes"] == {"answer": 13}


def test_scores_between_zero_and_one_use_the_threshold_for_correctness() -> None:
    s = summarize([task("a", [0.5, 0.4, 1.0, 0.0])], k=2)
    assert s["correct"] == 2 and s["accuracy"] == 0.5
    assert s["mean_reward"] == pytest.approx(1.9 / 4)
    assert s["pass@2"] == pytest.approx(1 - 1 / 6)


def test_nothing_valid_gives_no_rates() -> None:
    s = summarize([task("a", [SCORE_ERROR, SCORE_ERROR])], k=2)
    assert s["accuracy"] is None and s["mean_reward"] is None and s["pass@2"] is None and s["avg@2"] is None
    assert s["errors"] == 2


def test_repeats_use_all_samples_and_report_their_spread() -> None:
    # k = 2, R = 2: slots 0-1 are repeat 0, slots 2-3 repeat 1.
    tasks = [task("a", [1, 0, 0, 0]), task("b", [1, 1, 0, 1])]
    s = summarize(tasks, k=2, repeats=2)
    assert s["pass@2"] == pytest.approx(((1 - 3 / 6) + 1.0) / 2)  # from n=4: a c=1, b c=3
    assert s["accuracy"] == pytest.approx(4 / 8)
    assert [r["accuracy"] for r in s["by_repeat"]] == pytest.approx([3 / 4, 1 / 4])
    assert [r["pass@2"] for r in s["by_repeat"]] == pytest.approx([1.0, 0.5])
    assert s["accuracy_std"] == pytest.approx(math.sqrt(((0.75 - 0.5) ** 2 + (0.25 - 0.5) ** 2) / 1))
    assert s["pass@2_std"] == pytest.approx(math.sqrt(2 * 0.25 ** 2))


def test_breakdown_by_type_and_per_task_rows() -> None:
    tasks = [task("a", [1, 1], "add"), task("b", [0, 1], "add"), task("c", [0, SCORE_ERROR], "mul")]
    by_type = summarize_by_type(tasks, k=2)
    assert list(by_type) == ["add", "mul"]
    assert by_type["add"]["tasks"] == 2 and by_type["add"]["accuracy"] == pytest.approx(3 / 4)
    assert by_type["add"]["pass@2"] == 1.0
    assert by_type["mul"]["errors"] == 1 and by_type["mul"]["pass@2"] == 0.0
    rows = per_task_rows(tasks)
    assert rows[2] == {"id": "c", "type": "mul", "valid": 1, "correct": 0, "errors": 1, "mean_reward": 0.0}


def test_records_are_classified_by_status_score_and_outcome() -> None:
    assert classify(None, 3) == Sample(3, error=MISSING)
    ok = classify({"status": "ready", "score": 1.0, "outcome": "answer", "num_turns": 2}, 0)
    assert ok.valid and ok.score == 1.0 and ok.num_turns == 2
    limit = classify({"status": "ready", "score": 0.0, "outcome": "turns_limit_error"}, 0)
    assert limit.valid and limit.score == 0.0  # the model's failure: a valid, wrong sample
    assert classify({"status": "ready", "score": 0.0, "outcome": "failed_error"}, 0).error == FAILED_ERROR
    assert classify({"status": "failed", "score_error": "judge down", "outcome": "answer"}, 0).error == SCORE_ERROR
    assert classify({"status": "failed", "outcome": None}, 0).error == "slot_failed"


def test_paired_difference_compares_the_same_tasks_with_a_95_percent_interval() -> None:
    from agentrl.cli.report import render
    from agentrl.eval.metrics import paired_difference

    def rows(correct: dict[str, int]) -> dict:
        return {"per_task": [{"id": t, "correct": c, "valid": 1} for t, c in correct.items()]
                + [{"id": "broken", "correct": 0, "valid": 0}]}

    warmup = rows({"a": 0, "b": 0, "c": 1, "d": 1, "only_here": 1})
    after = rows({"a": 1, "b": 0, "c": 1, "d": 0, "e": 1})
    found = paired_difference(warmup, after)
    diffs = [1, 0, 0, -1]  # tasks a..d; "e", "only_here" and the invalid "broken" are not paired
    half = 1.96 * statistics.stdev(diffs) / 2
    assert found["tasks"] == 4 and (found["better"], found["worse"]) == (1, 1)
    assert found["difference"] == 0 and found["ci95"] == pytest.approx([-half, half])
    assert paired_difference(rows({"a": 1}), rows({"a": 0}))["difference"] is None  # one task: no interval

    summary = {"wall_s": None, "groups_dropped": {}, "steps": 1, "trajectories": 4, "samples_trained": 4,
               "samples_skipped_stale": 0, "groups_kept": 1, "failures": {}, "reward_by_version": [],
               "diagnosis": [], "eval_paired": {"from": "warmup", "to": "after", **found},
               "eval": {label: {"accuracy": 0.5, "mean_reward": 0.5, "num_tasks": 4} for label in ("warmup", "after")}}
    assert any(line.startswith("after over warmup: +0.000 held-out accuracy, paired 95% interval [")
               for line in render(summary))
    assert not any("the trainer ended after" in line for line in render(summary))
    summary.update(train_steps=24, steps=22)  # the tasks ran out before the step budget
    assert "the trainer ended after 22 of 24 steps: no task was left to sample" in "\n".join(render(summary))
    summary.update(train_time_s=330.0, tasks_left=0)  # a time limit, but the tasks ran out first
    assert "the trainer ended after 22 of 24 steps: no task was left to sample" in "\n".join(render(summary))
    summary.update(tasks_left=17)  # the time limit came first
    assert "the trainer stopped at its time limit of 330 s after 22 of 24 steps (17 tasks not sampled yet)" in (
        "\n".join(render(summary)))


def test_the_summary_names_the_task_types_the_last_stage_changed_and_those_never_right() -> None:
    from agentrl.cli.report import eval_entry, type_lines

    def evaluation(right: dict[str, int]) -> dict:  # an `agentrl eval` result of 4 tasks per type, greedy
        return eval_entry({"metrics": {}, "by_type": {name: {"correct": c, "valid_samples": 4, "samples": 4}
                                                      for name, c in right.items()}})

    evals = {"before": evaluation({"add": 0, "mul": 0, "avg": 0}), "warmup": evaluation({"add": 3, "mul": 1, "avg": 0}),
             "after": evaluation({"add": 4, "mul": 1, "avg": 0})}
    assert type_lines(evals) == ["by task type, warmup → after: add 3 → 4 of 4",
                                 "right in no evaluation: avg (1 of 3 types)"]
    evals["after"] = evaluation({"add": 3, "mul": 1, "avg": 2})
    assert type_lines(evals) == ["by task type, warmup → after: avg 0 → 2 of 4"]
    assert type_lines({"warmup": evaluation({"add": 1}), "after": evaluation({"add": 2})}) == []  # one type
    assert type_lines({"after": evaluation({"add": 1, "mul": 0})}) == []  # one evaluation
