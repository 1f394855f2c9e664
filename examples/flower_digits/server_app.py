"""ServerApp of the Flower digits example: CLMA with the private regional evaluation, on
the round engine, over Flower's own strategy loop.

The federation config (``clma/configs/clma_vs_fedavg.toml`` unless the run config's
``config-path`` names another) gives every rule: seed, rounds, participation, cohorting,
evaluation, budget policy. The strategy is :class:`clma.flower.CLMA` (the engine's steps:
quarantine, cohorting, merging, FedAvg or DP-FedAvg per cohort) wrapped in
:class:`clma.flower.private.PrivateEvaluation` (the engine's secure sums and releases,
each charged to the ledger before its noise); run config ``private-evaluation = "false"``
trains only. The ledger lives in ``ledger-dir`` (run config; empty: a fresh temporary
folder). Client ids are the nodes' partition ids, so cohort ids and members compare
one-to-one with the Prefect flow's on the same config.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from clma.config import FederationConfig, load_config
from clma.engine import make_cohorter
from clma.flower import CLMA
from clma.flower.private import PrivateEvaluation

DEFAULT_CONFIG = "clma_vs_fedavg.toml"

#: The last run's outcome in this process (tests and notebooks read it).
LAST_RUN: dict[str, Any] = {}


def config_from(run_config: dict[str, Any], config_path: str | None = None) -> FederationConfig:
    """The federation config: ``config_path``, else run config ``config-path``, else the
    bundled ``clma/configs/clma_vs_fedavg.toml``."""
    path = config_path or str(run_config.get("config-path", "") or "")
    if not path:
        path = str(resources.files("clma.configs").joinpath(DEFAULT_CONFIG))
    return load_config(path)


def make_server_app(config_path: str | None = None, ledger_dir: str | None = None) -> ServerApp:
    """A ServerApp bound to ``config_path`` / ``ledger_dir`` (None: the run config's)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        from clma.sim.federation import build_federation

        cfg = config_from(context.run_config, config_path)
        ledger = ledger_dir or str(context.run_config.get("ledger-dir", "") or "") or None
        if ledger:
            cfg = cfg.model_copy(update={"budget": cfg.budget.model_copy(
                update={"state_dir": ledger})})
        assets = build_federation(cfg).assets()  # the public parts: model, probe, regions
        strategy: Any = CLMA(config=cfg, assets=assets, cohorter=make_cohorter(cfg),
                             min_available_nodes=cfg.clients)
        if str(context.run_config.get("private-evaluation", "true")).lower() == "true":
            strategy = PrivateEvaluation(strategy)
        initial = ArrayRecord(assets.model_spec.build(seed=cfg.seed).state_dict())
        result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=cfg.rounds)
        LAST_RUN.clear()
        LAST_RUN.update(strategy=strategy, result=result,
                        cohort_history=strategy.cohort_history)
        out = str(context.run_config.get("out", "") or "")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            doc = {"config": cfg.name, "seed": cfg.seed,
                   "cohort_history": {str(r): {str(c): len(m) for c, m in snap.items()}
                                      for r, snap in strategy.cohort_history.items()},
                   "regional": {str(r): res.regional for r, res in strategy.results.items()}}
            (Path(out) / "flower_summary.json").write_text(json.dumps(doc, indent=2) + "\n")

    return app


app = make_server_app()
