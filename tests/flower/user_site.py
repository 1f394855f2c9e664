"""A user's own model and data sources for the Flower tests, written as a package outside
the project (``siteuser``) into a temporary folder put on ``sys.path`` / ``PYTHONPATH``.

``siteuser.model:site_mlp``: a torch model class of the user's (Linear -> BatchNorm1d ->
ReLU -> Linear, running statistics in the vector); ``siteuser.model:wider_mlp``: the same
with another hidden width (a device with the wrong install).
``siteuser.data``: digits shards by the node's partition id: ``local_arrays`` (arrays;
clients 0, 2 rotate their labels by +1 and 1, 3 by -1 from round 3), ``local_loaders``
(torch DataLoaders), ``by_federation`` (a site in two federations: its own data for
``siteuser-fed``, the built-in demo's shard for the others), and sources that break a
rule.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np

MODEL = '''
from torch import nn


class SiteMLP(nn.Module):
    def __init__(self, hidden=24):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.BatchNorm1d(hidden),
                                  nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x):
        return self.body(x)


def site_mlp():
    return SiteMLP()


def wider_mlp():
    return SiteMLP(hidden=32)
'''

DATA = '''
import numpy as np
import torch
from sklearn.datasets import load_digits

DRIFT = {0: 1, 2: 1, 1: -1, 3: -1}


def _shard(node_config, n_clients=6):
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32).reshape(-1, 64)
    y = d.target.astype(np.int64)
    pid = int(node_config["partition-id"])
    idx = np.random.default_rng(11).permutation(len(y))[:1200]
    mine = idx[pid::n_clients]
    cut = int(0.75 * len(mine))
    return x[mine[:cut]], y[mine[:cut]], x[mine[cut:]], y[mine[cut:]]


def local_arrays(node_config):
    tx, ty, ex, ey = _shard(node_config)
    shift = DRIFT.get(int(node_config["partition-id"]), 0)

    def at(x, y):
        def part(round_number):
            if round_number >= 3 and shift:
                return x, (y + shift) % 10
            return x, y
        return part

    return {"train": at(tx, ty), "eval": at(ex, ey)}


def local_loaders(node_config):
    tx, ty, ex, ey = _shard(node_config)
    g = torch.Generator().manual_seed(int(node_config["partition-id"]))
    train = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(tx), torch.from_numpy(ty)),
        batch_size=16, shuffle=True, generator=g)
    ev = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(ex), torch.from_numpy(ey)),
        batch_size=64)
    return train, ev


def by_federation(node_config, federation):
    """A site in two federations: its own data for "siteuser-fed", the built-in demo's
    simulated shard for the others (the federation config comes from the run)."""
    if federation.name == "siteuser-fed":
        return local_arrays(node_config)
    from clma.sim.demo import simulated_shard

    return simulated_shard(node_config, federation)


def wrong_width(node_config):
    tx, ty, ex, ey = _shard(node_config)
    return {"train": (tx[:, :50], ty), "eval": (ex[:, :50], ey)}


def float_labels(node_config):
    tx, ty, ex, ey = _shard(node_config)
    return {"train": (tx, ty.astype(np.float32)), "eval": (ex, ey)}


def not_data(node_config):
    return "data"


def raises(node_config):
    raise OSError("the site's disk is not mounted")
'''

BROKEN = '''
import this_package_does_not_exist  # noqa: F401
'''


def write_package(root: Path) -> Path:
    """Write ``siteuser`` (model, data, broken) under ``root``; returns ``root``."""
    pkg = Path(root) / "siteuser"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("", "utf-8")
    for name, text in (("model", MODEL), ("data", DATA), ("broken", BROKEN)):
        (pkg / f"{name}.py").write_text(textwrap.dedent(text), "utf-8")
    return Path(root)


def write_probe(path: Path, n: int = 32) -> Path:
    """A public probe set for the server: ``n`` digit images (64 features), float32."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images[-n:] / 16.0).astype(np.float32).reshape(n, 64)
    np.savez(path, features=x)
    return Path(path)


def on_path(root: Path) -> None:
    """Make ``siteuser`` importable in this process."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    for m in [m for m in sys.modules if m == "siteuser" or m.startswith("siteuser.")]:
        del sys.modules[m]


#: Run as ``python -c DEVICE_CHECK <config-json> <model-spec>`` with ``siteuser`` on
#: PYTHONPATH: a SuperNode's ClientApp with ``data-source = siteuser.data:local_arrays``
#: answers the roster and trains once; prints which of clma.sim, prefect, mlflow loaded.
DEVICE_CHECK = """
import json, sys
from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from clma.engine.clients import TrainRequest, TrainSettings
from clma.flower import codec
from clma.flower.clientapp import make_client_app
import numpy as np

TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1
cfg_json, spec_json, n_params = sys.argv[1], sys.argv[2], int(sys.argv[3])
ctx = Context(run_id=7, node_id=100, node_config={"partition-id": 2,
              "data-source": "siteuser.data:local_arrays"}, state=RecordDict(),
              run_config={"config-json": cfg_json, "model-spec": spec_json})
app = make_client_app()
def ask(content, call):
    m = Message(content=content, dst_node_id=100, message_type=codec.MESSAGE_TYPES[call])
    m.metadata.__dict__["_message_id"] = "m-" + call
    r = app(m, ctx)
    assert not r.has_error(), r.error.reason
    return r
r = ask(codec.encode_roster_request(), "roster")
layout = codec.decode_roster_layout(r.content)
req = TrainRequest(1, {2: 0}, {0: np.zeros(n_params, np.float32)}, TrainSettings(1, 0.1, 16, 0.5))
r = ask(codec.encode_train_request(req, 2), "train")
u = codec.decode_train_reply(r.content, round_number=1, client_id=2, cohort_id=0,
                             n_params=n_params)
print(json.dumps({"n_params": layout[0], "n_samples": u.n_samples,
                  "loaded": sorted(m for m in sys.modules
                                   if m.split(".")[0] in ("prefect", "mlflow")
                                   or m.startswith("clma.sim"))}))
"""
