"""Fixtures of the engine tests: small federations driven through the library directly
(``FederationEngine`` over ``SimulatedClients``; no Prefect), simulated clients that drop
chosen clients at a chosen step or report fixed vectors, and a spy on the noise sampler.

tests/ is not a package: shared helpers are fixtures (factories) defined here."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

import numpy as np
import pytest

from clma.config import FederationConfig, validate_config
from clma.device import DeviceSecAgg
from clma.engine import FederationEngine, open_budget
from clma.engine.budget import budgeted_evaluation, charge_distributed
from clma.engine.evaluation import QUANTISATION_LEVELS
from clma.privacy.secagg import FixedPointQuantiser
from clma.sim.clients import SimulatedClients
from clma.sim.federation import build_federation

ROOT = Path(__file__).resolve().parents[3]
SMALL = ROOT / "tests" / "flows" / "small.toml"
SHIPPED_POLICY = ROOT / "clma" / "policy" / "privacy_policy_v1.toml"

_FEDERATIONS: dict[str, object] = {}


def _federation(config: FederationConfig):
    """The simulated world of ``config`` (cached: building it is deterministic in the
    config, and nothing in a SimulatedFederation changes while it is played)."""
    key = config.model_dump_json(exclude={"budget", "tracking", "state", "federation"})
    if key not in _FEDERATIONS:
        _FEDERATIONS[key] = build_federation(config)
    return _FEDERATIONS[key]


class ScriptedClients(SimulatedClients):
    """Simulated clients whose secure-aggregation steps follow a script.

    ``drops``: client id -> the step it stops answering at (``advertise``,
    ``share_keys``, ``masked_input`` or ``unmasking``), through the simulation's own
    dropout mechanism (instead of the seeded ``evaluation.dropout_rate`` draw). ``report``: client id ->
    the float ``(32,)`` report its device quantises and inputs (instead of its metric
    report on its own data); the device still clips and quantises it to the layout.
    ``flags``: round -> clients whose training reply raises the drift flag whatever their
    detector says (a cheap stand-in for a detected drift; the update is the device's)."""

    def __init__(self, federation, *, drops: Mapping[int, str] | None = None,
                 report: Callable[[int], np.ndarray] | None = None,
                 flags: Mapping[int, Collection[int]] | None = None, **kw) -> None:
        super().__init__(federation, **kw)
        self.drops = None if drops is None else dict(drops)
        self.report = report
        self.flags = {int(r): set(cs) for r, cs in (flags or {}).items()}

    def train(self, request):
        out = super().train(request)
        for c in self.flags.get(request.round, ()):
            if c in out.ok:
                out.ok[c] = dataclasses.replace(out.ok[c], drift_flag=True)
        return out

    def _dropped_at(self, round_number: int, client_id: int, stage: str) -> bool:
        if self.drops is None:
            return super()._dropped_at(round_number, client_id, stage)
        return self.drops.get(client_id) == stage

    def secagg_advertise(self, request):
        out = super().secagg_advertise(request)
        for c, stage in (self.drops or {}).items():
            if stage == "advertise" and c in out.ok:
                del out.ok[c]
                out.failed[c] = "dropped out (simulated)"
        if self.report is None:
            return out
        quant = FixedPointQuantiser(request.layout.lower_bounds(), request.layout.upper_bounds(),
                                    request.quantisation_levels)
        for c in list(out.ok):
            dev = DeviceSecAgg(c, request.round)
            self._secagg[c] = dev
            out.ok[c] = dev.advertise(quant.quantise(np.clip(
                self.report(c), request.layout.lower_bounds(), request.layout.upper_bounds())),
                request.sessions_of(c))
        return out


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """One torch thread, as the flow and the Dask actors run (``torch.set_num_threads(1)``):
    the models are tiny, so more threads only contend for the machine's two cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def sampler_spy(monkeypatch):
    """Counts every noise draw of the release path (clma.release.aggregate.sample)."""
    import clma.release.aggregate as agg

    calls = []
    real = agg.sample

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(agg, "sample", spy)
    return calls


@pytest.fixture
def tiny_config() -> Callable[..., FederationConfig]:
    """``tiny_config(**sections)``: 20 clients (regions central 5, islands 1, north 7,
    south 4, west 3), seed 0, no tracking, no ledger, evaluation epsilon 2 with seeded
    noise (tests compare published values across runs); each keyword updates that
    section (``evaluation={...}``) or sets a top-level field."""

    def make(**sections) -> FederationConfig:
        base = {"name": "tiny", "seed": 0, "rounds": 3, "clients": 20,
                "data": {"probe_size": 32}, "tracking": {"enabled": False},
                "budget": {"enabled": False},
                "evaluation": {"epsilon": 2.0, "noise_seeded": True}}
        for k, v in sections.items():
            base[k] = {**base[k], **v} if isinstance(base.get(k), dict) else v
        return validate_config(base)

    return make


@pytest.fixture
def make_engine() -> Callable[..., FederationEngine]:
    """``make_engine(config, clients=None, *, budget=None, state=None, **client_kw)``: the
    federation's engine over simulated clients (``ScriptedClients`` when ``drops`` or
    ``report`` is given). ``budget=True`` opens the config's ledger."""

    def make(config: FederationConfig, clients=None, *, budget=None, state=None,
             **client_kw) -> FederationEngine:
        sim = _federation(config)
        if clients is None:
            clients = (ScriptedClients(sim, **client_kw) if client_kw
                       else SimulatedClients(sim))
        if budget is True:
            budget = open_budget(config)
        return FederationEngine(config, sim.assets(), clients, budget=budget, state=state)

    return make


@pytest.fixture
def scripted_clients():
    """The :class:`ScriptedClients` class."""
    return ScriptedClients


@pytest.fixture
def secure_sums():
    """``secure_sums(engine, round)``: the secure sums of every client of the roster,
    each evaluating its current cohort's model (no training in between)."""

    def run(engine: FederationEngine, round_number: int, unmask=None):
        ids = engine.roster.client_ids
        return engine.evaluator.secure_sums(engine.clients, round_number, ids, engine.region_of,
                                            engine.state.assignments(ids),
                                            engine.state.cohort_models, unmask=unmask)

    return run


@pytest.fixture
def evaluate_round(secure_sums):
    """``evaluate_round(engine, round, gate=None, step=direct)``: one ledger-driven
    evaluation round of every client (what ``FederationEngine.evaluate`` runs; in
    distributed mode the noised releases are charged before the secure sums): returns
    ``(ledger view, EvaluationOutcome)``."""

    def run(engine: FederationEngine, round_number: int, *, gate=None, **kw):
        ids = engine.roster.client_ids
        region_of = {c: engine.region_of[c] for c in ids}
        charged = unmask = None
        if engine.evaluator.distributed:  # charged before secure aggregation
            groups = engine.evaluator.session_groups(round_number, ids, engine.region_of)
            charged = charge_distributed(engine.evaluator, engine.budget, groups, region_of,
                                         round_number, gate=gate)
            unmask = charged.unmask()
        ev = engine.evaluator.open_round(secure_sums(engine, round_number, unmask))
        view = budgeted_evaluation(engine.evaluator, ev, engine.budget, region_of, gate=gate,
                                   charged=charged, **kw)
        return view, engine.evaluator.finish(ev, budget_view=view)

    return run


@pytest.fixture
def device_reports():
    """``device_reports(engine, round)``: client id -> the quantised uint64 ``(32,)``
    report its device computes on its own evaluation data with its cohort's model (what
    it inputs into secure aggregation), recomputed here for the test's references."""
    from clma.device import quantised_report

    def run(engine: FederationEngine, round_number: int) -> dict[int, np.ndarray]:
        layout = engine.evaluator.state.layout()
        out = {}
        for c, model in engine.state.models_for(engine.roster.client_ids).items():
            proba, labels = engine.clients.learners[c].predict(model, round_number)
            out[c] = quantised_report(proba, labels, layout, QUANTISATION_LEVELS)
        return out

    return run


@pytest.fixture
def write_policy(tmp_path) -> Callable[..., Path]:
    """``write_policy(source="privacy_policy_v1.toml", *, approver_keys=False, **settings)``:
    a copy of a policy file shipped in clma/policy/ with the given ``key = value`` lines
    replaced (``epsilon_per_client_per_epoch``, ``epoch_length_rounds``,
    ``regional_cadence_rounds``, ``minimum_group_size``...) and ``policy_version`` set to
    ``clma-privacy-policy-test``; ``approver_keys=True`` appends the test approvers' public
    keys (``tests.clma.approval_keys``), so that their signed approvals count. Returns its
    path."""
    from clma.budget.approval_token import policy_entry
    from tests.clma.approval_keys import APPROVERS, key_entry

    counter = iter(range(10**6))

    def write(source: str = SHIPPED_POLICY.name, *, approver_keys: bool = False,
              **settings) -> Path:
        text = (SHIPPED_POLICY.parent / source).read_text()
        for key, value in settings.items():
            text, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value!r}", text)
            assert n == 1, f"{key} is not a line of {source}"
        text, n = re.subn(r'(?m)^policy_version = ".*"$',
                          'policy_version = "clma-privacy-policy-test"', text)
        assert n == 1
        if approver_keys:
            text += "\n" + "\n".join(policy_entry(key_entry(name)) for name in APPROVERS)
        p = tmp_path / f"policy_{next(counter)}.toml"
        p.write_text(text)
        return p

    return write
