"""fed-clma 0.1.1's README snippets, run unchanged (read from the vendored wheel's METADATA,
:mod:`tests.flower.fedclma_ref`), and one test per deliberate departure (README, "Coming
from fed-clma"). The ServerApp snippet: test_fedclma_serverapp.py."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from clma.flower.arrays import ArrayLayout
from clma.flower.fedclma import decode_train_reply

from . import fedclma_ref as ref

# the README's code blocks, exactly as published (fed-clma 0.1.1's METADATA)
ANY_MODALITY = ref.snippet("CLMA(param_selector=LastLayers(2))")
PAPER = ref.snippet("CLMACohorter(center=False")
INFERENCE = ref.snippet("monitor = InferenceDriftMonitor()")
CLIENT = ref.snippet("from clma.client import DriftReporter")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Linear(8, 3))


def _exec(snippet: str, **names):
    ns = dict(names)
    exec(compile(textwrap.dedent(snippet), "<fed-clma README>", "exec"), ns)  # noqa: S102
    return ns


def test_any_modality_snippet_and_the_selectors_reach_the_strategy():
    model = _model()
    model[0].requires_grad_(False)  # a frozen "backbone"
    ns = _exec(ANY_MODALITY, model=model)
    strat = ns["CLMA"](param_selector=ns["trainable_selector"](model))
    named = model.state_dict()
    assert strat.param_selector.select(named) == ["1.weight", "1.bias", "2.weight", "2.bias"]
    model[0].requires_grad_(True)  # read live, not a snapshot
    assert "0.weight" in strat.param_selector.select(named)
    assert ns["CLMA"](param_selector=ns["LastLayers"](2)).param_selector.n == 2


def test_paper_snippet_builds_the_papers_cohorter():
    ns = _exec(PAPER)
    strat = ns["CLMA"](param_selector=ns["AllParams"](),
                       cohorter=ns["CLMACohorter"](center=False,
                                                   clusterer=ns["AutoKMeans"](fixed_k=2)))
    assert strat.cohorter.center is False and strat.cohorter.clusterer.fixed_k == 2


def test_inference_monitor_snippet_fires_once_on_a_step_not_on_noise():
    rng = np.random.default_rng(0)
    losses = np.concatenate([rng.normal(1.0, 0.1, 200), rng.normal(1.5, 0.1, 100)])
    stream = [SimpleNamespace(x=torch.tensor(v), y=None) for v in losses]
    seen: list[float] = []
    fired: list[int] = []
    _exec(INFERENCE, inference_stream=stream, model=lambda x: seen.append(float(x)) or x,
          loss_fn=lambda out, y: out, trigger_clma_round=lambda: fired.append(len(seen)))
    assert len(fired) == 1 and fired[0] > 200  # after the step, once
    # departure: fed-clma's monitor (a 0.1 rise over the previous batch) fires on the noise
    from clma.drift import LossThresholdDetector

    per_batch = LossThresholdDetector(gamma=0.1)
    assert sum(per_batch.update(v) for v in losses[:200]) > 10


def test_client_snippet_replies_in_fedclma_format_and_persists_the_detector(run_id):
    model = _model()
    layout = ArrayLayout.of(ArrayRecord(model.state_dict()))
    losses = iter([1.0, 0.95, 1.5, 1.45])
    ns = _exec(CLIENT, model=model, trainloader=None, ArrayRecord=ArrayRecord,
               train_one_round=lambda m, loader: (next(losses), 32))
    context = Context(run_id=7, node_id=5, node_config={}, state=RecordDict(), run_config={})
    flags = []
    for r in range(1, 5):
        msg = Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                  "config": ConfigRecord({"server-round": r,
                                                          "clma-cohort": 0})}),
                      dst_node_id=5, message_type="train")
        reply = ns["train"](msg, context)
        assert reply.content["metrics"]["clma-loss"] == pytest.approx([1.0, .95, 1.5, 1.45][r - 1])
        upd = decode_train_reply(reply.content, layout, client_id=3, cohort_id=0)
        assert upd.n_samples == 32 and upd.params.shape == (layout.n_params,)
        flags.append(upd.drift_flag)
    assert flags == [False, False, True, False]  # state survived fresh DriftReporters

    from clma.client import cohort_id

    assert cohort_id(msg) == 0


# ------------------------------------------------------------------ departures
def test_departure_last_layers_counts_layers_not_tensors():
    from clma import LastLayers

    named = _model().state_dict()
    # fed-clma's LastLayers(2) = the last 2 tensors (2.weight, 2.bias); here: 2 layers
    assert LastLayers(1).select(named) == ["2.weight", "2.bias"]
    assert LastLayers(2).select(named) == ["1.weight", "1.bias", "2.weight", "2.bias"]


def test_departure_all_params_skips_integer_counters():
    from clma import AllParams

    names = AllParams().select(_model().state_dict())
    assert "1.running_mean" in names and "1.num_batches_tracked" not in names


def test_departure_cohort_history_is_keyed_by_round(run_id):
    from clma import CLMA

    s = CLMA()
    assert s.cohort_history == {}  # before start: round -> {cohort id: [client ids]}
    with pytest.raises(ValueError, match="merge_cohorts_threshold"):
        CLMA(merge_cohorts_threshold=2.5)  # displacement cosine in [0, 2]


def test_reporter_refuses_a_zero_example_count(run_id):
    from clma.client import STATE_KEY, DriftReporter

    context = Context(run_id=7, node_id=5, node_config={}, state=RecordDict(), run_config={})
    msg = Message(RecordDict({"config": ConfigRecord({"clma-cohort": 0})}), dst_node_id=5,
                  message_type="train")
    arrays = ArrayRecord(_model().state_dict())
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="num_examples: must be an integer >= 1"):
            DriftReporter(context).build_reply(msg, arrays=arrays, loss=1.0, num_examples=bad)
    assert STATE_KEY not in context.state  # refused before the detector saw the loss
    reply = DriftReporter(context).build_reply(msg, arrays=arrays, loss=1.0, num_examples=1)
    assert reply.content["metrics"]["num-examples"] == 1 and STATE_KEY in context.state


def test_kstest_module_and_one_cohort_per_client_match_fedclma():
    ref.load()
    from fedclma_ref.cohort.kstest import ks_pvalue as theirs
    from fedclma_ref.cohort.kstest import signed_ks_statistic as their_ks

    from clma import CLMACohorter, OneCohortPerClient
    from clma.cohort import signed_ks_statistic
    from clma.cohort.kstest import ks_pvalue
    from clma.cohort.kstest import signed_ks_statistic as alias

    assert alias is signed_ks_statistic
    for d in (-0.9, -0.2, 0.0, 0.01, 0.05, 0.3, 1.0):
        for n1, n2 in ((5, 7), (100, 100), (1000, 50_000)):
            root = (n1 * n2 / (n1 + n2)) ** 0.5
            lam = abs(d) * (root + 0.12 + 0.11 / root)
            if d == 0 or lam >= 0.25:  # fed-clma's 100-term series has converged
                assert ks_pvalue(d, n1, n2) == pytest.approx(theirs(d, n1, n2), rel=1e-9,
                                                             abs=1e-15)
            else:  # departure: its truncated alternating series is off; Q(lam) -> 1
                assert ks_pvalue(d, n1, n2) == pytest.approx(1.0, abs=1e-9)
    assert theirs(0.01, 5, 7) == pytest.approx(0.99928, abs=1e-5)  # lam = 0.019
    # the series by hand at one point: lambda = 0.3 * (sqrt(50) + 0.12 + 0.11 / sqrt(50))
    lam = 0.3 * (50 ** 0.5 + 0.12 + 0.11 / 50 ** 0.5)
    series = sum(2 * (-1) ** (j - 1) * np.exp(-2 * j * j * lam * lam) for j in range(1, 50))
    assert ks_pvalue(0.3, 100, 100) == pytest.approx(series, rel=1e-12)
    with pytest.raises(ValueError, match="statistic: must be a finite KS statistic"):
        ks_pvalue(1.5, 3, 3)
    with pytest.raises(ValueError, match="n_reference: must be an integer >= 1"):
        ks_pvalue(0.1, 3, 0)
    rng = np.random.default_rng(0)
    reference = rng.normal(size=500)
    for shift in (-0.5, 0.4):  # same magnitude (scipy's D) and the same direction
        x = rng.normal(size=500) + shift
        assert signed_ks_statistic(x, reference) == pytest.approx(their_ks(x, reference))
    m = rng.normal(size=(5, 200)) + np.array([[0.5], [0.5], [-0.5], [-0.5], [0.5]])
    out = CLMACohorter(clusterer=OneCohortPerClient()).cohort(list(range(5)), m,
                                                             np.zeros(200))
    assert sorted(out.assignments.values()) == [0, 1, 2, 3, 4]


def test_extension_abcs_have_fedclmas_abstract_methods_and_parameters():
    import inspect

    ref.load()
    import fedclma_ref.cohort as their_cohort
    import fedclma_ref.drift as their_drift
    import fedclma_ref.params as their_params

    import clma

    pairs = [(clma.DriftDetector, their_drift.DriftDetector),
             (clma.ParamSelector, their_params.ParamSelector),
             (clma.Cohorter, their_cohort.Cohorter), (clma.Clusterer, their_cohort.Clusterer)]
    for ours, theirs in pairs:
        assert ours.__abstractmethods__ == theirs.__abstractmethods__, ours
        for name in theirs.__abstractmethods__:
            a = list(inspect.signature(getattr(ours, name)).parameters)
            b = list(inspect.signature(getattr(theirs, name)).parameters)
            assert len(a) == len(b), (ours, name, a, b)

    class Never(clma.DriftDetector):  # a fed-clma-style detector plugs into DriftReporter
        def __init__(self):
            self.seen = []

        def update(self, loss):
            self.seen.append(loss)
            return False

        def reset(self):
            self.seen = []

        def state_dict(self):
            return {"n": float(len(self.seen))}

        def load_state_dict(self, state):
            self.seen = [0.0] * int(state["n"])

    from clma.client import DriftReporter

    context = Context(run_id=7, node_id=5, node_config={}, state=RecordDict(), run_config={})
    for _ in range(3):
        DriftReporter(context, detector_factory=Never).observe(9.0)
    assert DriftReporter(context, detector_factory=Never).detector.seen == [0.0] * 3
