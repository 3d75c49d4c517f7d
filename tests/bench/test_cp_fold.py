"""bench.kernels.cp_fold: both folds timed per (H, R) into one JSON that names its device."""

import json
import sys

from bench.kernels import cp_fold


def test_cp_fold_writes_rows_for_every_head_and_rank_count(tmp_path, monkeypatch):
    out = tmp_path / "fold.json"
    argv = ["cp_fold", "--heads", "1", "2", "--dim", "4", "--ranks", "1", "3", "5", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    cp_fold.main()
    result = json.loads(out.read_text())
    assert result["device"] and result["K"] == result["V"] == 4
    assert [(row["H"], row["R"]) for row in result["rows"]] == [(h, r) for h in (1, 2) for r in (1, 3, 5)]
    for row in result["rows"]:
        assert row["loop_ms"] > 0 and row["batched_ms"] > 0
        assert row["max_rel_diff"] <= 1e-5  # float32: the two folds round differently, nothing more
