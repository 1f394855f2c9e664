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
