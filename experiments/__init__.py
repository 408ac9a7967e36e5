"""Experiments on the built-in toy (`sd3_testbed`): ablations as trainer runs, the artifact probe, key bias,
delta-file reuse and the softmax-then-T5 schedule. Each is a script (`python -m experiments.ablations`) that
prints its table and writes its JSON, the table included, under `experiments/results/`; docs/toy.md discusses
them. Not shipped in the wheel."""

from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
"""Where the experiments write their JSON (and, under `.cache/`, what they keep between runs)."""
