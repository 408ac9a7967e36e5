"""Run metrics as JSON lines from rank 0, and the rank-0 progress bar.

Keys are grouped and carry units: `loss/total`, `loss/flow`, `lr/new`, `grad_norm`,
`throughput(img/s)`, `time/step(s)`, `memory/max_reserved(GiB)` (CUDA only). Lines of the attention
transfer, before the fine-tune, carry `"stage": "transfer"`, `transfer/loss` and `transfer/{module}`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from t5core.atomic import write_text_atomic

__all__ = ["MetricsWriter", "Progress", "read_metrics"]

logger = logging.getLogger(__name__)


class MetricsWriter:
    """Appends one JSON object per logged step to `metrics.jsonl` (rank 0 only; other ranks no-op)."""

    def __init__(self, path: str | Path, *, enabled: bool) -> None:
        self.path, self.enabled = Path(path), enabled

    def resume_at(self, step: int, *, stage: str | None = None) -> None:
        """Drop the lines written after the checkpoint a killed run resumes from: those of `stage` (None:
        the fine-tune) past `step`, and those of the fine-tune when resuming an earlier stage."""
        if not self.enabled or not self.path.is_file():
            return
        lines = [line for line in self.path.read_text(encoding="utf-8").splitlines() if line]
        kept = []
        for line in lines:
            record = json.loads(line)
            same = record.get("stage") == stage
            if (same and record["step"] <= step) or (not same and stage is None):
                kept.append(line)
        write_text_atomic(self.path, "".join(line + "\n" for line in kept))

    def write(self, step: int, values: dict[str, Any], *, stage: str | None = None) -> None:
        """Append one line; `stage` marks the lines of a stage before the fine-tune (`transfer`)."""
        if not self.enabled:
            return
        record = {"step": step, **({"stage": stage} if stage else {}), **values}
        with self.path.open("a", encoding="utf-8") as stream:
            stream.write(json.dumps(record, sort_keys=True) + "\n")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every line of a `metrics.jsonl` file, in order."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line]


class Progress:
    """The rank-0 progress bar: step, loss, step/s and ETA (tqdm); silent elsewhere or when disabled."""

    def __init__(self, *, total: int, initial: int, enabled: bool) -> None:
        self._bar = tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)

    def update(self, loss: float) -> None:
        self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
