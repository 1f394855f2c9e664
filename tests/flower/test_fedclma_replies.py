"""clma.flower.CLMA accepts train replies in fed-clma 0.1.1's format (named ``"arrays"``,
``num-examples`` / ``clma-drift`` / ``clma-loss`` metrics, no ``"clma"`` header): the
rounds are bit-identical to the same clients replying in this project's wire format, and
malformed fed-clma replies are dropouts like malformed native ones."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, MetricRecord

from clma.flower import CLMA
from clma.flower.codec import decode_train_reply
from clma.sim.federation import build_federation

from .conftest import tiny_config
from .test_flower_transport import _grid


@pytest.fixture(scope="module")
def world():
    import torch

    torch.set_num_threads(1)
    cfg = tiny_config()
    cfg = cfg.model_copy(update={"budget": cfg.budget.model_copy(update={"enabled": False})})
    return cfg, build_federation(cfg)


def _as_fedclma(layout_of, spoil=None):
    """A tamper hook rewriting each native train reply into fed-clma's reply format."""

    def tamper(kind, node, reply):
        if kind != "train" or reply.has_error():
            return reply
        c = reply.content
        head = c["clma"]
        upd = decode_train_reply(c, round_number=int(head["round"]),
                                 client_id=int(head["client-id"]),
                                 cohort_id=int(head["cohort-id"]))
        for k in list(c.keys()):
            del c[k]
        c["arrays"] = layout_of().to_record(upd.params)
        c["metrics"] = MetricRecord({"num-examples": upd.n_samples,
                                     "clma-loss": 0.25, "clma-drift": int(upd.drift_flag)})
        if spoil is not None:
            spoil(node, c)
        return reply

    return tamper


def _run(cfg, fed, tamper_for=None, rounds=2):
    strat = CLMA(config=cfg, assets=fed.assets(), min_available_nodes=cfg.clients)
    tamper = tamper_for(lambda: strat.layout) if tamper_for else None
    init = ArrayRecord(fed.spec.build(seed=cfg.seed).state_dict())
    strat.start(grid=_grid(cfg, tamper=tamper), initial_arrays=init, num_rounds=rounds)
    return strat


def test_fedclma_format_replies_give_the_same_rounds(run_id, world):
    cfg, fed = world
    native = _run(cfg, fed)
    fc = _run(cfg, fed, tamper_for=_as_fedclma)
    assert fc.results[1].participants == cfg.clients
    assert fc.cohort_history == native.cohort_history
    assert native.cohort_models.keys() == fc.cohort_models.keys()
    for c, v in native.cohort_models.items():
        np.testing.assert_array_equal(fc.cohort_models[c], v)


def test_malformed_fedclma_replies_are_dropouts(run_id, world):
    cfg, fed = world

    def spoil(node, c):
        i = node - 1000
        if i == 0:
            c["metrics"]["clma-drift"] = 2
        elif i == 1:
            c["metrics"]["num-examples"] = 0
        elif i == 2:
            del c["metrics"]["clma-drift"]  # not a fed-clma reply any more, no header
        elif i == 3:
            name = next(iter(c["arrays"].keys()))
            del c["arrays"][name]

    strat = _run(cfg, fed, tamper_for=lambda lay: _as_fedclma(lay, spoil), rounds=1)
    res = strat.results[1]
    assert res.participants == cfg.clients - 4 and res.dropouts == 4
