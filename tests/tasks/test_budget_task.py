"""tasks/budget.py: what stays in the task layer, the ledger's Prefect artifact key. The
ledger logic (charges before noise, re-runs, the gate, DP-FedAvg) is tested on the
library in tests/clma/engine/test_budget.py."""

from __future__ import annotations

import re


def test_prefect_artifact_key_is_lowercase_letters_digits_dashes():
    from tasks.budget import prefect_artifact_key

    for name in ("clma-digits", "E2E_small.v2", "---", "a" * 100):
        key = prefect_artifact_key(name)
        assert re.fullmatch(r"[a-z0-9-]+", key), key
    assert prefect_artifact_key("A_b") != prefect_artifact_key("a-b")


def test_mlflow_ledger_file_gets_one_block_per_round_of_that_rounds_epoch(tmp_path,
                                                                        mlflow_store,
                                                                        monkeypatch):
    """budget/ledger.json after rounds 1, 2 and 11 (epochs of 10 rounds): three blocks, each
    the ledger's rows of the round's epoch with the round in after_round; the spend of the
    round-1 charge is in the blocks of rounds 1 and 2, epoch 1's block starts at 0."""
    import json
    from pathlib import Path

    import prefect.artifacts

    from clma.budget import LineItem, MechanismEvent
    from clma.config import load_config
    from clma.engine import open_budget
    from tasks.budget import ledger_history_block, report_budget_round
    from tasks.tracking import FederationTracker

    artifacts = []
    monkeypatch.setattr(prefect.artifacts, "create_table_artifact",
                        lambda **kw: artifacts.append(kw))
    cfg = load_config(Path(__file__).parents[2] / "clma" / "configs" / "default.toml")
    b = open_budget(cfg, default_dir=tmp_path / "ledger", fresh=True)
    assert b.policy.budget.epoch_length_rounds == 10
    with b.ledger.charge(0, "global.accuracy", LineItem.EVALUATION_GLOBAL,
                         [MechanismEvent.laplace(0.5)]):
        pass
    t = FederationTracker(mlflow_store)
    t.start("fed-ledger", run_name="r", params={}, tags={})
    blocks = []
    for r in (1, 2, 11):
        blocks.append(ledger_history_block(b, r))
        report_budget_round(b, t, r)
    path = t.client.download_artifacts(t.run_id, "budget/ledger.json", str(tmp_path / "dl"))
    doc = json.loads(Path(path).read_text())
    cols = doc["columns"]
    assert cols[0] == "after_round"
    rows = [dict(zip(cols, row, strict=True)) for row in doc["data"]]
    n = len(b.ledger.table(0))
    assert n == len(b.ledger.table(1)) and len(rows) == 3 * n
    assert [r["after_round"] for r in rows] == [1] * n + [2] * n + [11] * n
    assert [r["epoch"] for r in rows] == [0] * (2 * n) + [1] * n
    for k, block in enumerate(blocks):
        for i, row in enumerate(rows[k * n:(k + 1) * n]):
            assert row == {c: block[c][i] for c in cols}
    spent = {(r["after_round"], r["line_item"]): r["spent_epsilon"] for r in rows}
    assert spent[(1, "evaluation.global")] == spent[(2, "evaluation.global")] == 0.5
    assert spent[(11, "evaluation.global")] == 0.0
    # the Prefect artifact: the whole ledger, the epochs charged so far (epoch 0 only)
    assert len(artifacts) == 3 and artifacts[-1]["table"] == [
        r.model_dump(mode="json") for r in b.ledger.table()] and len(b.ledger.table()) == n
    b.close()
