"""fed-clma 0.1.1's README snippets that this project supports, run unchanged (the text
is copied literally and executed), and one test per deliberate departure (README, "Coming
from fed-clma")."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from clma.flower.arrays import ArrayLayout
from clma.flower.fedclma import decode_train_reply

ANY_MODALITY = """
from clma import CLMA, LastLayers
from clma.adapters.torch import trainable_selector

# Tabular / small CNN — the paper's setting. Defaults are fine.
CLMA()

# Vision or language backbone — restrict the signal to the head, so the KS test
# isn't swamped by millions of near-static backbone weights.
CLMA(param_selector=LastLayers(2))

# Fine-tuning a frozen backbone — ask the model which parameters actually move.
CLMA(param_selector=trainable_selector(model))
"""

PAPER = """
from clma import CLMA, AllParams
from clma.cohort import AutoKMeans, CLMACohorter

CLMA(
    param_selector=AllParams(),
    cohorter=CLMACohorter(center=False, clusterer=AutoKMeans(fixed_k=2)),
)
"""

INFERENCE = """
from clma.client import InferenceDriftMonitor

monitor = InferenceDriftMonitor()
for batch in inference_stream:
    if monitor.observe(loss_fn(model(batch.x), batch.y)):
        trigger_clma_round()   # your transport
        monitor.reset()
"""

CLIENT = """
from clma.client import DriftReporter
from flwr.clientapp import ClientApp

app = ClientApp()

@app.train()
def train(msg, context):
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    loss, num_examples = train_one_round(model, trainloader)

    return DriftReporter(context).build_reply(
        msg,
        arrays=ArrayRecord(model.state_dict()),
        loss=loss,
        num_examples=num_examples,
    )
"""


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
