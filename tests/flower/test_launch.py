"""The pieces of `clma run` on real clients that need no SuperLink: the [federation.flower]
config rules, the Flower connection file, the job handed to the ServerApp, what the
devices see of the config, the federation id devices key their state by, and the app
folder Flower builds."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from clma.config import ConfigError, load_config, validate_config
from flows.flower_launch import FlowerLaunchError, _flower_home, app_dir, federation_id
from flows.flower_serverapp import Job, device_config, load_job

LOCAL = Path(__file__).resolve().parents[2] / "clma" / "configs" / "flower_local.toml"


@pytest.mark.parametrize(("flower", "extra", "message"), [
    ({"superlink": "127.0.0.1:0"}, {}, "federation.flower.superlink: port must be an integer in 1..65535"),
    ({"superlink": "https://a:9093"}, {}, "without a URL scheme"),
    ({"superlink": "::1:9093"}, {}, "IPv6 host must be written in brackets"),
    ({"superlink": "nohost"}, {}, "must be host:port"),
    ({"insecure": True, "root_certificates": "ca.crt"}, {}, "root_certificates: only used with insecure = false"),
    ({"node_count": 7}, {}, "node_count: at most 'clients' (6)"),
    ({"timeout_seconds": 0.0}, {}, "federation.flower.timeout_seconds"),
    ({"colour": "red"}, {}, "federation.flower.colour: unknown field"),
    ({}, {"evaluation": {"dropout_rate": 0.1}}, "evaluation.dropout_rate: simulates dropouts"),
])
def test_flower_connection_rules_name_the_field(flower, extra, message):
    data = load_config(LOCAL).model_dump(mode="json")
    data["federation"]["flower"].update(flower)
    for sec, over in extra.items():
        data[sec].update(over)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_config(data)


def test_the_flower_section_belongs_to_the_flower_transport():
    with pytest.raises(ConfigError, match="federation.flower: only applies to federation.transport = 'flower'"):
        validate_config({"federation": {"flower": {"insecure": True}}})
    cfg = validate_config({"federation": {"transport": "flower"}})
    assert cfg.flower.superlink == "127.0.0.1:9093" and cfg.flower.insecure is False
    local = load_config(LOCAL)
    assert (local.transport, local.flower.node_count, local.flower.insecure) == ("flower", 6, True)
    assert local.evaluation.noise_seeded is False  # real clients: secure noise


def test_seeded_noise_is_refused_on_the_flower_path_unless_a_test_allows_it(tmp_path):
    from clma.flower import CLMA
    from clma.flower.transport import check_noise_source
    from flows.flower_launch import launch

    local = load_config(LOCAL)
    assert check_noise_source(local) == "opendp"
    for over in ({"evaluation": {"noise_seeded": True}},
                 {"training": {"dp": {"enabled": True, "noise_seeded": True}}}):
        data = local.model_dump(mode="json")
        for sec, v in over.items():
            data[sec].update(v)
        seeded = validate_config(data)
        with pytest.raises(ConfigError, match="seeded noise is reproducible and NOT private"):
            check_noise_source(seeded)
        with pytest.raises(ConfigError, match="NOT private"):  # before anything is submitted
            launch(seeded, out_dir=tmp_path / "out", state_dir=None)
        data["testing"] = {"allow_seeded_noise_not_private": True}
        assert check_noise_source(validate_config(data)) == "seeded-simulation"
    # a clma.flower strategy is real clients whatever federation.transport says
    sim = validate_config({"evaluation": {"noise_seeded": True}})
    assert sim.transport == "simulation" and sim.seeded_noise_refusal(real_server=False) is None
    with pytest.raises(ConfigError, match="the flower transport"):
        CLMA(config=sim, model_fn=lambda: None)._ensure_started(None, None)


def test_the_connection_file_names_the_superlink_and_its_certificates(tmp_path):
    cfg = load_config(LOCAL)
    home = _flower_home(tmp_path, cfg)
    doc = tomllib.loads((home / "config.toml").read_text())
    assert doc["superlink"] == {"default": "clma", "clma": {"address": "127.0.0.1:9093",
                                                           "insecure": True}}
    ca = tmp_path / "ca.crt"
    tls = cfg.model_copy(update={"federation": cfg.federation.model_copy(update={
        "flower": cfg.flower.model_copy(update={"insecure": False, "root_certificates": str(ca)})})})
    with pytest.raises(FlowerLaunchError, match="root_certificates: .* is not a readable file"):
        _flower_home(tmp_path / "x", tls)
    ca.write_text("PEM")
    doc = tomllib.loads((_flower_home(tmp_path / "y", tls) / "config.toml").read_text())
    assert doc["superlink"]["clma"] == {"address": "127.0.0.1:9093", "insecure": False,
                                        "root-certificates": str(ca.resolve())}


def test_the_job_round_trips_and_a_foreign_file_is_refused(tmp_path):
    cfg = load_config(LOCAL)
    job = Job(config=cfg.model_dump(mode="json"), out_dir=str(tmp_path / "out"),
              cwd=str(tmp_path), job_dir=str(tmp_path / "job"), state_dir=None, resume=None,
              max_new_rounds=2, env={"MLFLOW_TRACKING_URI": "sqlite:///x.db"})
    back = load_job(job.write())
    assert back == job and validate_config(back.config) == cfg
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="is not a clma.flower-job/1 file"):
        load_job(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="not a readable job file"):
        load_job(tmp_path / "missing.json")


def test_devices_see_only_what_their_learner_needs():
    data = load_config(LOCAL).model_dump(mode="json")
    data["state"]["dir"] = "/srv/clma/state"
    data["data"]["region_partition"] = "/srv/clma/regions.toml"
    data["tracking"]["experiment"] = "secret-project"
    dev = device_config(validate_config(data))
    assert set(dev) == {"name", "seed", "rounds", "clients", "data", "drift", "model", "training"}
    assert dev["data"]["region_partition"] is None
    assert "/srv" not in str(dev) and "secret-project" not in str(dev)
    cfg = validate_config(dev)  # what the ClientApp validates
    from clma.sim.federation import build_federation

    full = build_federation(load_config(LOCAL))
    mine = build_federation(cfg)  # the same shards, whatever the region file
    for c in full.clients:
        assert (mine.clients[c].train_y == full.clients[c].train_y).all()


def test_federation_id_is_stable_for_a_state_folder_and_fresh_without(tmp_path):
    cfg = load_config(LOCAL)
    a = federation_id(cfg, tmp_path / "s")
    assert a == federation_id(cfg, tmp_path / "s") == federation_id(cfg.with_overrides(rounds=9),
                                                                    tmp_path / "s")
    assert a != federation_id(cfg, tmp_path / "t") != federation_id(cfg.with_overrides(seed=3),
                                                                    tmp_path / "s")
    assert federation_id(cfg, None) != federation_id(cfg, None)


def test_the_app_folder_is_a_valid_flower_app():
    from flwr.cli.build import build_fab_from_disk
    from flwr.supercore.object_ref import validate

    app = app_dir(load_config(LOCAL))
    doc = tomllib.loads((app / "pyproject.toml").read_text())
    comps = doc["tool"]["flwr"]["app"]["components"]
    for ref in comps.values():
        ok, why = validate(ref, project_dir=app)
        assert ok, why
    assert set(doc["tool"]["flwr"]["app"]["config"]) == {"config-json", "job", "federation-id",
                                                          "model-spec"}
    assert len(build_fab_from_disk(app)) > 0


@pytest.mark.slow
def test_clma_run_without_a_superlink_fails_naming_it(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = tmp_path / "nolink.toml"
    cfg.write_text(LOCAL.read_text().replace("127.0.0.1:9093", f"127.0.0.1:{port}"))
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "ph"), FLWR_TELEMETRY_ENABLED="0",
               FLWR_DISABLE_UPDATE_CHECK="1", TMPDIR=str(tmp_path / "tmp"))
    r = subprocess.run([str(Path(sys.executable).with_name("clma")), "run", "--config", str(cfg),
                        "--out", str(tmp_path / "out"), "--quiet"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2
    assert f"clma: flwr run on 127.0.0.1:{port} failed" in r.stderr
    assert "Connection to the SuperLink is unavailable" in r.stderr
    assert not (tmp_path / "out").exists()  # no empty --out folder left behind
    assert not [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith("clma-")]


def test_a_scheduled_run_on_the_flower_transport_submits_the_serverapp(tmp_path, monkeypatch):
    import flows.flower_launch as launcher
    from flows.flower_launch import LaunchResult
    from flows.serve import scheduled_federation_flow

    calls = []

    def fake_launch(cfg, **kw):
        calls.append((cfg, kw))
        return LaunchResult("123", "finished:completed", {"schema": "clma.summary/1"},
                            tmp_path / "log")

    monkeypatch.setattr(launcher, "launch", fake_launch)
    out = scheduled_federation_flow.fn(str(LOCAL), str(tmp_path / "state"), 2)
    assert out == {"schema": "clma.summary/1"}
    (cfg, kw), = calls
    assert cfg.transport == "flower" and kw["max_new_rounds"] == 2
    assert kw["state_dir"] == str(tmp_path / "state") and kw["resume"] is None

    def failed(cfg, **kw):
        return LaunchResult("124", "finished:failed", None, tmp_path / "log", "boom")

    monkeypatch.setattr(launcher, "launch", failed)
    with pytest.raises(RuntimeError, match="Flower run 124 ended finished:failed: boom"):
        scheduled_federation_flow.fn(str(LOCAL), str(tmp_path / "state"), 1)


@pytest.mark.parametrize("seed", [0, 3])
def test_the_local_config_separates_its_two_families_in_process(seed, tmp_path):
    """What the deployment test asserts over SuperNodes (three cohorts), in process and under
    the shipped (improved) cohorting: the drifted group of four is two families of two, which
    only the leading split sees at seeds 0 and 3 (no component above the broken stick)."""
    import torch

    from clma.engine import FederationEngine, open_budget
    from clma.sim.clients import SimulatedClients
    from clma.sim.federation import build_federation

    torch.set_num_threads(1)
    data = load_config(LOCAL).model_dump(mode="json")
    assert "method" not in tomllib.loads(LOCAL.read_text())["cohort"]  # the default method
    data.update(seed=seed, federation={"transport": "simulation"})
    data["budget"]["state_dir"] = str(tmp_path)
    cfg = validate_config(data)
    fed = build_federation(cfg)
    eng = FederationEngine(cfg, fed.assets(), SimulatedClients(fed), budget=open_budget(cfg))
    reasons = []
    cohort = eng.cohorter.cohort

    def recorded(*args, **kwargs):
        out = cohort(*args, **kwargs)
        reasons.extend(g.reason for g in out.groups)
        return out

    eng.cohorter.cohort = recorded
    for r in range(1, cfg.rounds + 1):
        eng.run_round(r)
    reg = eng.state.registry
    assert sorted(sorted(reg.members(c)) for c in reg.active_cohorts()) == [
        [0, 2], [1, 3], [4, 5]]
    assert any(x.startswith("leading component split") for x in reasons)
