"""An interrupted ablation sweep resumes from its results file (benchmarks/ablations.py)."""

from __future__ import annotations

import json
from dataclasses import asdict

from benchmarks import ablations


def test_a_sweep_resumes_only_with_the_same_budget_and_evaluation(tmp_path, monkeypatch):
    monkeypatch.setattr(ablations, "RESULTS_DIR", tmp_path)
    budget = ablations.Budget.trainer_default()
    plan = ablations.EvalPlan(180, 0, ("teacher", "t5"))  # a tuple, stored as a JSON list
    rows = [{"row": "t5", "seed": 0}]
    meta = {"budget": asdict(budget), "eval": asdict(plan)}
    (tmp_path / "sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, default=str))
    assert ablations._previous("sweep", budget, plan) == rows
    assert ablations._previous("sweep", budget, ablations.EvalPlan(360, 0, ("teacher", "t5"))) == []
    assert ablations._previous("sweep", ablations.Budget.trainer_default(steps=5), plan) == []
