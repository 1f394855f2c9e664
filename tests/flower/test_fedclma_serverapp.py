"""fed-clma 0.1.1's README Usage snippets -- its ServerApp and its ClientApp -- run unchanged
(read from the wheel's METADATA) against this package, over an in-process grid that answers
like SuperNodes: a mixed federation of ClientApps whose ``DriftReporter`` is fed-clma's own
(the snippet exec'd with ``clma`` = fed-clma 0.1.1) and ours, with two drift families that
end in their own cohorts -- the same partition fed-clma's own strategy finds on the same
world. Also: the vendored wheel is checked against its RECORD hashes."""

from __future__ import annotations

import ast
import base64
import contextlib
import hashlib
import io

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord

from . import fedclma_ref as ref

N_ROUNDS = 10  # fixed by the snippet (num_rounds=10)
STABLE, FAMILY_A, FAMILY_B = (0, 1, 2), (3, 4, 5), (6, 7, 8)
DRIFT_ROUND = 3
#: node ids (Flower's are random 64-bit ints; sorted order = client ids 0..8 here)
NODES = [9100 + 7 * i for i in range(9)]
#: which DriftReporter each client's ClientApp imports: fed-clma's own or this package's
FEDCLMA_REPORTER = {0, 3, 6, 7}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 3))


class _Loader:
    """One client's local data: 128 points in 4-D, labels = the argmax of a fixed linear
    map; from round DRIFT_ROUND family A's labels shift by +1 (mod 3), family B's by +2."""

    W = np.random.default_rng(99).normal(size=(4, 3))

    def __init__(self, client: int) -> None:
        rng = np.random.default_rng(client)
        self.x = torch.tensor(rng.normal(size=(128, 4)), dtype=torch.float32)
        self.y = torch.tensor(np.argmax(self.x.numpy() @ self.W, axis=1))
        self.shift = 1 if client in FAMILY_A else 2 if client in FAMILY_B else 0
        self.calls = 0
        self.cohorts: list[int] = []

    def labels(self) -> torch.Tensor:
        return (self.y + self.shift) % 3 if self.calls >= DRIFT_ROUND else self.y


def _train_one_round(model, loader):
    """The user's training: the received model's loss on the local data (what the drift
    rule compares), then 20 full-batch SGD steps. Returns (loss, num_examples)."""
    loader.calls += 1
    y = loader.labels()
    loss_fn = torch.nn.CrossEntropyLoss()
    model.eval()
    with torch.no_grad():
        before = float(loss_fn(model(loader.x), y))
    model.train()
    for _ in range(20):  # plain SGD, lr 0.2 (torch.optim would import torch._dynamo: ~30 s)
        model.zero_grad()
        loss_fn(model(loader.x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.2 * p.grad
    return before, len(y)


def _client_app(client: int, loaders: dict[int, _Loader]):
    """fed-clma's ClientApp snippet, exec'd unchanged for one node (its own globals: model,
    trainloader), importing fed-clma's DriftReporter or ours."""
    source = ref.snippet("from clma.client import DriftReporter")
    loader = loaders[client] = _Loader(client)

    def train_one_round(model, trainloader):
        from clma.client import cohort_id as ours  # reads fed-clma's config key too

        trainloader.cohorts.append(ours(_current["msg"]))
        return _train_one_round(model, trainloader)

    names = dict(model=_model(), trainloader=loader, train_one_round=train_one_round,
                 ArrayRecord=ArrayRecord)
    if client in FEDCLMA_REPORTER:
        with ref.fedclma_as_clma():
            ns = ref.run(source, **names)
    else:
        ns = ref.run(source, **names)
    app = ns["app"]

    def node(msg, context):
        _current["msg"] = msg
        return app(msg, context)

    node.reporter = ns["DriftReporter"]
    return node


_current: dict = {}


def _federation():
    loaders: dict[int, _Loader] = {}
    apps = {NODES[c]: _client_app(c, loaders) for c in range(9)}
    return ref.AppGrid(apps), loaders


def _server(strategy_from_fedclma: bool, grid) -> list | dict:
    """fed-clma's ServerApp snippet, unchanged, run by Flower's ``ServerApp.__call__``; the
    cohort history it prints, parsed."""
    from flwr.app import Context, RecordDict

    source = ref.snippet("from flwr.serverapp import ServerApp")
    names = dict(model=_model(), ArrayRecord=ArrayRecord)
    if strategy_from_fedclma:
        with ref.fedclma_as_clma():
            ns = ref.run(source, **names)
    else:
        ns = ref.run(source, **names)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ns["app"](grid, Context(run_id=7, node_id=0, node_config={}, state=RecordDict(),
                                run_config={}))
    return ast.literal_eval(out.getvalue().strip().splitlines()[-1])


def _partition(groups) -> set[frozenset]:
    return {frozenset(g) for g in groups}


@pytest.fixture(scope="module")
def run_id_module():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1
    yield
    TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None


@pytest.fixture(scope="module")
def ours(run_id_module):
    """The snippets on this package; the strategy the ServerApp made and its Result kept
    (CLMA.start wrapped) for the departure checks."""
    from clma.flower.strategy import CLMA

    torch.set_num_threads(1)
    grid, loaders = _federation()
    runs = []
    inherited = CLMA.start

    def start(self, *args, **kwargs):
        result = inherited(self, *args, **kwargs)
        runs.append((self, result))
        return result

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CLMA, "start", start, raising=False)
        history = _server(False, grid)
    assert len(runs) == 1
    return history, grid, loaders, runs[0]


# ------------------------------------------------------------------------ tests
def test_vendored_wheel_files_match_its_record():
    record = (ref.ROOT / "fed_clma-0.1.1.dist-info" / "RECORD").read_text().splitlines()
    checked = 0
    paths = set()
    for line in record:
        path, digest, _ = line.rsplit(",", 2)
        paths.add(path)
        if not digest:  # RECORD itself
            continue
        raw = hashlib.sha256((ref.ROOT / path).read_bytes()).digest()
        assert digest == "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode(), path
        checked += 1
    assert checked == 23
    on_disk = {p.relative_to(ref.ROOT).as_posix() for p in ref.ROOT.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert on_disk == paths  # nothing added, nothing missing


def test_every_readme_python_block_is_run_by_a_test():
    blocks = ref.python_blocks()
    markers = ["import clma            # not fed_clma",            # Install (import check)
               "from flwr.serverapp import ServerApp",             # Usage: ServerApp (here)
               "from clma.client import DriftReporter",            # Usage: ClientApp (here)
               "CLMA(param_selector=LastLayers(2))",               # Any modality
               "monitor = InferenceDriftMonitor()",                 # Algorithm 4
               "CLMACohorter(center=False"]                         # paper-exact
    assert len(blocks) == len(markers)
    for b, m in zip(blocks, markers, strict=True):
        assert m in b


def test_install_block_imports_this_package():
    ns = ref.run(ref.snippet("import clma            # not fed_clma"))
    from clma.flower.strategy import CLMA

    assert ns["CLMA"] is CLMA and ns["clma"].__file__.endswith("clma/__init__.py")
    assert "fixtures" not in ns["clma"].__file__


def test_serverapp_snippet_runs_a_mixed_federation_and_separates_the_drift_families(ours):
    history, grid, loaders, _ = ours
    # the reporters really differ: fed-clma's own class for some nodes, ours for the others
    kinds = {c: grid.apps[NODES[c]].reporter.__module__ for c in range(9)}
    assert {kinds[c] for c in FEDCLMA_REPORTER} == {"fedclma_ref.client"}
    assert {kinds[c] for c in set(range(9)) - FEDCLMA_REPORTER} == {"clma.client"}
    assert sorted(history) == list(range(1, N_ROUNDS + 1))
    for r, cohorts in history.items():  # every client replied and was accepted each round
        assert sorted(c for m in cohorts.values() for c in m) == list(range(9)), r
    for r in range(1, DRIFT_ROUND):
        assert list(history[r].values()) == [list(range(9))]
    final = history[N_ROUNDS]
    assert _partition(final.values()) == _partition([STABLE, FAMILY_A, FAMILY_B])
    assert [k for k, v in final.items() if sorted(v) == list(STABLE)] == [0]  # root cohort
    # each client trained in the cohort the server assigned (clma-cohort of its config)
    for c, loader in loaders.items():
        assert len(loader.cohorts) == N_ROUNDS
        expect = [next(k for k, v in history[r].items() if c in v) for r in range(1, N_ROUNDS + 1)]
        # the message of round r carries the cohort of the end of round r-1 (0 in round 1)
        assert loader.cohorts == [0] + expect[:-1], c


def test_server_asks_partition_ids_once_and_sends_only_train_messages(ours):
    _, grid, _, _ = ours
    kinds = [k for k, _ in grid.sent]
    assert kinds.count("query.clma_roster") == 9 and kinds[:9] == ["query.clma_roster"] * 9
    assert kinds[9:] == ["train"] * (9 * N_ROUNDS)  # no evaluate message (no plain eval)


@pytest.mark.slow  # a second 10-round federation, on fed-clma's own strategy
def test_fedclma_strategy_finds_the_same_partition_on_the_same_world(run_id_module):
    grid, _ = _federation()
    history = _server(True, grid)
    assert len(history) == N_ROUNDS  # fed-clma: a list of {node id: cohort} per round
    final: dict[int, list[int]] = {}
    for node, cohort in history[-1].items():
        final.setdefault(cohort, []).append(NODES.index(node))
    assert _partition(final.values()) == _partition([STABLE, FAMILY_A, FAMILY_B])
    assert sorted(final[0]) == list(STABLE)


def test_departure_result_arrays_are_the_largest_cohorts_model(ours):
    history, _, _, (strategy, result) = ours
    cohorts = strategy.cohort_arrays()
    assert sorted(cohorts) == sorted(history[N_ROUNDS])  # root + the two drift cohorts
    got = result.arrays.to_numpy_ndarrays()
    for c, rec in cohorts.items():  # three sizes of 3: the tie goes to the lowest id (root)
        same = all(np.array_equal(a, b) for a, b in zip(got, rec.to_numpy_ndarrays(),
                                                          strict=True))
        assert same == (c == 0), c
    # the cohort models load into the user's model (keys, shapes, dtypes of initial_arrays)
    _model().load_state_dict(result.arrays.to_torch_state_dict())


def test_departure_train_metrics_are_the_mean_loss_and_the_cohort_count(ours):
    _, _, loaders, (_, result) = ours
    per_round = result.train_metrics_clientapp
    assert sorted(per_round) == list(range(1, N_ROUNDS + 1))
    for r, m in per_round.items():
        # no drift flag: its mean over the replies times their number = the drifted count
        assert set(m) == {"clma-loss", "n-cohorts"}
        assert m["n-cohorts"] == (1 if r < DRIFT_ROUND else 3)
    # the loss is the replies' mean (equal weights: 128 examples each): the drift round's
    # is far above the round before's, as the drifted clients' losses jumped
    assert per_round[DRIFT_ROUND]["clma-loss"] > 2 * per_round[DRIFT_ROUND - 1]["clma-loss"]
    assert all(len(ld.y) == 128 for ld in loaders.values())


def test_roster_gives_fedclma_nodes_the_ids_no_node_claimed(run_id_module):
    """Native ClientApps claim their partition ids; nodes without a query handler (fed-clma
    ClientApps) get the free ids in node-id order; without the strategy's layout, or once
    the ids run out, they are left out with the reason."""
    from flwr.app import Message
    from flwr.clientapp import ClientApp

    from clma.config import FederationConfig
    from clma.flower import codec
    from clma.flower.arrays import ArrayLayout
    from clma.flower.transport import FlowerTransport

    def native(pid):
        return lambda msg, ctx: Message(codec.encode_roster_reply(pid), reply_to=msg)

    fedclma_app = ClientApp()
    fedclma_app.train()(lambda msg, ctx: None)
    apps = {50: native(2), 40: fedclma_app, 30: native(0), 20: fedclma_app, 60: fedclma_app}

    def roster(clients, layout=True):
        t = FlowerTransport(ref.AppGrid(apps), FederationConfig(clients=clients),
                            connect_timeout=0)
        t.layout = ArrayLayout.of(ArrayRecord(_model().state_dict())) if layout else None
        return t, t.roster()

    t, r = roster(5)
    assert t.node_of == {0: 30, 2: 50, 1: 20, 3: 40, 4: 60}
    assert t.fedclma_clients == {1, 3, 4} and list(r.client_ids) == [0, 1, 2, 3, 4]
    t, r = roster(4)
    assert t.node_of == {0: 30, 2: 50, 1: 20, 3: 40} and list(r.client_ids) == [0, 1, 2, 3]
    assert t.roster_failures == {60: "no client id left in [0, clients) for this node"}
    t, r = roster(5, layout=False)
    assert t.node_of == {0: 30, 2: 50} and t.fedclma_clients == set()
    assert set(t.roster_failures) == {20, 40, 60}
    assert "only clma.CLMA serves those" in t.roster_failures[20]
