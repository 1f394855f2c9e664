"""clma.config: defaults, TOML loading, field-naming validation errors, overrides."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from clma.config import (
    COHORT_METHODS,
    CohortConfig,
    ConfigError,
    DriftConfig,
    FederationConfig,
    TrainingConfig,
    default_config,
    load_config,
    validate_config,
    with_cohort_method,
)

ROOT_CONFIGS = Path(__file__).resolve().parents[2] / "clma" / "configs"


def _event(**kw):
    ev = {"round": 1, "kind": "label_rotation", "shift": 1, "clients": [0], "family": "a"}
    ev.update(kw)
    return ev


def test_default_config_is_the_documented_federation():
    cfg = default_config()
    assert (cfg.rounds, cfg.clients, cfg.seed, cfg.name) == (10, 60, 0, "clma-digits")
    assert cfg.data.dataset == "digits"
    # concept drift into two opposite families at two rounds
    rounds = sorted({ev.round for ev in cfg.drift.events})
    assert rounds == [4, 7]
    for r in rounds:
        shifts = sorted(ev.shift for ev in cfg.drift.events if ev.round == r)
        assert shifts == [-1, 1]
        fams = {ev.family for ev in cfg.drift.events if ev.round == r}
        assert len(fams) == 2
    # load_config(None) is the same object content
    assert load_config(None) == cfg


def test_load_config_reads_toml_and_matches_validate(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(
        'name = "t1"\nrounds = 3\nclients = 6\n[data]\npartition = "dirichlet"\n'
        "dirichlet_alpha = 0.5\n[[drift.events]]\nround = 2\nkind = \"blur\"\n"
        'magnitude = 1.5\nfamily = "blurry"\nclients = [1, 2]\n'
    )
    cfg = load_config(p)
    assert cfg.name == "t1" and cfg.rounds == 3 and cfg.clients == 6
    assert cfg.data.partition == "dirichlet" and cfg.data.dirichlet_alpha == 0.5
    assert cfg.drift.events[0].kind == "blur" and cfg.drift.events[0].magnitude == 1.5
    # untouched sections keep their defaults
    assert cfg.training == FederationConfig().training


@pytest.mark.parametrize(
    ("data", "field", "rule"),
    [
        ({"rounds": 0}, "rounds", "greater than 0"),
        ({"clients": -3}, "clients", "greater than 0"),
        ({"seed": -1}, "seed", "greater than or equal to 0"),
        ({"seed": 2**32}, "seed", "less than"),
        ({"bogus": 1}, "bogus", "unknown field"),
        ({"data": {"holdout_fraction": 1.5}}, "data.holdout_fraction", "less than 1"),
        ({"data": {"holdout_fraction": 0.0}}, "data.holdout_fraction", "greater than 0"),
        ({"data": {"dirichlet_alpha": 0}}, "data.dirichlet_alpha", "greater than 0"),
        ({"data": {"partition": "zipf"}}, "data.partition", "'iid' or 'dirichlet'"),
        ({"data": {"dataset": "cifar10"}}, "data.data_dir", "required"),
        ({"drift": {"gamma": 0}}, "drift.gamma", "greater than 0"),
        ({"model": {"hidden": []}}, "model.hidden", "at least 1"),
        ({"model": {"hidden": [8, 0]}}, "model.hidden.1", "greater than 0"),
        ({"training": {"learning_rate": 11}}, "training.learning_rate", "less than or equal"),
        ({"training": {"participation": 0}}, "training.participation", "greater than 0"),
        ({"training": {"server_learning_rate": 0}}, "training.server_learning_rate",
         "greater than 0"),
        ({"training": {"server_learning_rate": 10.5}}, "training.server_learning_rate",
         "less than or equal"),
        ({"training": {"server_learning_rate_scope": "root"}},
         "training.server_learning_rate_scope", "'all' or 'drift_cohorts'"),
        ({"cohort": {"max_k": 1}}, "cohort.max_k", "greater than or equal to 2"),
        ({"cohort": {"leading_split_family_ratio": 1.2}}, "cohort.leading_split_family_ratio",
         "less than or equal to 1"),
        ({"cohort": {"leading_split_family_ratio": 0}}, "cohort.leading_split_family_ratio",
         "greater than 0"),
        ({"cohort": {"one_component": "kmeans"}}, "cohort.one_component",
         "'clusterer', 'two_means' or 'tested_two_means'"),
        ({"evaluation": {"epsilon": 0}}, "evaluation.epsilon", "greater than 0"),
        ({"evaluation": {"loss_max": -1}}, "evaluation.loss_max", "greater than 0"),
        ({"divergence": {"action": "ban"}}, "divergence.action", "'report'"),
        ({"name": "has space"}, "name", "letters, digits"),
        ({"name": ""}, "name", "at least 1"),
        ({"drift": {"events": [_event(shift=0)]}}, "drift.events.0", "non-zero 'shift'"),
        (
            {"drift": {"events": [_event(kind="rotation", shift=0, magnitude=0.0)]}},
            "drift.events.0",
            "positive 'magnitude'",
        ),
        ({"drift": {"events": [_event(clients=[0, 0])]}}, "drift.events.0", "more than once"),
        ({"drift": {"events": [_event(clients=[])]}}, "drift.events.0.clients", "at least 1"),
        ({"drift": {"events": [_event(kind="rain")]}}, "drift.events.0.kind", "label_rotation"),
        ({"rounds": 2, "drift": {"events": [_event(round=3)]}}, "drift.events[0].round",
         "beyond 'rounds'"),
        ({"clients": 4, "drift": {"events": [_event(clients=[4])]}}, "drift.events[0].clients",
         "client ids run from 0"),
        (
            {"drift": {"events": [_event(clients=[2]), _event(clients=[2], shift=-1)]}},
            "drift.events[1]",
            "already does",
        ),
    ],
)
def test_invalid_values_name_field_and_rule(data, field, rule):
    with pytest.raises(ConfigError) as info:
        validate_config(data)
    msg = str(info.value)
    assert msg.startswith("invalid configuration: ")
    assert field in msg
    assert rule in msg
    # one message, not a pydantic dump with URLs or input echo
    assert "errors.pydantic.dev" not in msg and "input_value" not in msg


def test_error_does_not_echo_secret_like_input():
    with pytest.raises(ConfigError) as info:
        validate_config({"training": {"learning_rate": "s3cr3t-value"}})
    assert "training.learning_rate" in str(info.value)
    assert "s3cr3t-value" not in str(info.value)


def test_load_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(binary)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text("[training]\nlocal_epochs = 0\n")
    with pytest.raises(ConfigError, match=r"training\.local_epochs"):
        load_config(wrong)


def test_config_is_frozen():
    cfg = default_config()
    with pytest.raises(Exception, match="frozen"):
        cfg.rounds = 3  # type: ignore[misc]


def test_with_overrides_drops_events_outside_smaller_federation():
    cfg = default_config()
    small = cfg.with_overrides(clients=5, rounds=5, seed=7)
    assert (small.clients, small.rounds, small.seed) == (5, 5, 7)
    # only round-4 events survive rounds=5; clients >= 5 are filtered out of each event
    assert [ev.round for ev in small.drift.events] == [4, 4]
    assert [ev.clients for ev in small.drift.events] == [[0, 4], [1]]
    # None values mean "keep"
    same = cfg.with_overrides(rounds=None, clients=None, seed=None)
    assert same == cfg
    # an event whose clients are all dropped disappears
    tiny = cfg.with_overrides(clients=1)
    assert [ev.clients for ev in tiny.drift.events] == [[0], [0]]
    assert {ev.shift for ev in tiny.drift.events} == {1}


def test_with_overrides_validates():
    with pytest.raises(ConfigError, match="rounds"):
        default_config().with_overrides(rounds=0)


def _paper():
    """The default federation with the paper's cohorting method (the library default of
    the first release)."""
    return validate_config(with_cohort_method(default_config().model_dump(mode="json"),
                                              "paper"))


def test_fingerprint_is_sha256_of_canonical_json_and_changes_with_values():
    cfg = _paper()
    data = cfg.model_dump(mode="json")
    del data["cohort"]["method"]
    # fields added since the first release, at their legacy values, are left out
    del data["drift"]["input_ks"], data["drift"]["paired_loss"]
    del data["cohort"]["leading_split_alpha"], data["cohort"]["leading_split_min_size"]
    del data["cohort"]["leading_split_family_ratio"], data["cohort"]["cosine_refinement"]
    del data["cohort"]["one_component"], data["cohort"]["refit_without_outliers"]
    del data["cohort"]["client_choice"]
    del data["training"]["server_learning_rate"], data["training"]["server_learning_rate_scope"]
    del data["training"]["server_momentum"], data["data"]["record_churn"]
    del data["model"]["factory"], data["data"]["source"]
    del data["model"]["weights"], data["data"]["probe"]
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
    assert cfg.fingerprint() == hashlib.sha256(blob.encode()).hexdigest()
    assert cfg.with_overrides(seed=1).fingerprint() != cfg.fingerprint()
    assert _paper().fingerprint() == cfg.fingerprint()
    # today's default method is not the legacy one: its fields are in the fingerprint
    data = default_config().model_dump(mode="json")
    del data["drift"]["input_ks"], data["drift"]["paired_loss"], data["cohort"]["leading_split_min_size"]
    del data["model"]["factory"], data["data"]["source"]
    del data["model"]["weights"], data["data"]["probe"], data["training"]["server_momentum"]
    del data["data"]["record_churn"]
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
    assert default_config().fingerprint() == hashlib.sha256(blob.encode()).hexdigest()
    split = cfg.model_copy(update={"cohort": cfg.cohort.model_copy(
        update={"leading_split_alpha": 0.01})})
    assert split.fingerprint() != cfg.fingerprint()


#: FederationConfig.fingerprint() of the default config as computed by the code of commits
#: 6015c7a (first release; whole dump) and 42e4594 (whole dump, with drift.input_ks).
FP_6015C7A = "828ca05a094ca53d451d9370f692f4a00781ad72d380047a215f933db5b97d02"
FP_42E4594 = "75efd6d87899dc73c10db0d931f4af843ead61de8a40a5168229d36a6c6ee9a8"


def test_fingerprint_is_the_first_releases_and_earlier_versions_are_recognised():
    cfg = _paper()
    assert cfg.fingerprint() == FP_6015C7A
    assert {FP_6015C7A, FP_42E4594} <= cfg.earlier_fingerprints()
    full = json.dumps(cfg.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    assert hashlib.sha256(full.encode()).hexdigest() in cfg.earlier_fingerprints()
    assert FP_42E4594 not in cfg.with_overrides(seed=1).earlier_fingerprints()


def test_flat_params_dotted_string_values():
    cfg = default_config()
    flat = cfg.flat_params()
    assert flat["rounds"] == "10"
    assert flat["name"] == "clma-digits"
    assert flat["training.learning_rate"] == "0.3"
    assert flat["model.hidden"] == "[64, 32]"
    assert flat["data.data_dir"] == "null"
    assert flat["cohort.enabled"] == "true"
    events = json.loads(flat["drift.events"])
    assert len(events) == 4 and events[0]["family"] == "rotate+1"
    assert all(isinstance(v, str) for v in flat.values())


# ------------------------------------------------------------------ cohort.method (issue 46)
def _method_fields(cfg: FederationConfig) -> dict:
    return {"cohort.components": cfg.cohort.components,
            "cohort.direction_rule": cfg.cohort.direction_rule,
            "cohort.leading_split_alpha": cfg.cohort.leading_split_alpha,
            "cohort.leading_split_family_ratio": cfg.cohort.leading_split_family_ratio,
            "cohort.cosine_refinement": cfg.cohort.cosine_refinement,
            "cohort.one_component": cfg.cohort.one_component,
            "cohort.refit_without_outliers": cfg.cohort.refit_without_outliers,
            "cohort.client_choice": cfg.cohort.client_choice,
            "training.server_learning_rate": cfg.training.server_learning_rate,
            "training.server_learning_rate_scope": cfg.training.server_learning_rate_scope,
            "drift.detector": cfg.drift.detector}


def test_the_shipped_default_runs_the_improved_method():
    """As shipped: default.toml, the library's FederationConfig(), and the sections alone
    (CohortConfig(), TrainingConfig()) all run the improved method."""
    expected = {"cohort.components": "broken_stick", "cohort.direction_rule": "none",
                "cohort.leading_split_alpha": 0.01, "cohort.leading_split_family_ratio": 0.7,
                "cohort.cosine_refinement": True, "cohort.one_component": "two_means",
                "cohort.refit_without_outliers": True, "cohort.client_choice": True,
                "training.server_learning_rate": 1.5,
                "training.server_learning_rate_scope": "drift_cohorts",
                "drift.detector": "paired_loss"}
    assert COHORT_METHODS["improved"] == expected
    shipped = default_config()
    assert shipped.cohort.method == "improved" and _method_fields(shipped) == expected
    assert 'method = "improved"' in (ROOT_CONFIGS / "default.toml").read_text()
    lib = FederationConfig()
    assert lib.cohort.method == "improved" and _method_fields(lib) == expected
    c, t = CohortConfig(), TrainingConfig()
    assert (c.components, c.direction_rule, c.leading_split_alpha) == (
        "broken_stick", "none", 0.01)
    assert (t.server_learning_rate, t.server_learning_rate_scope, t.server_momentum) == (
        1.5, "drift_cohorts", 0.0)
    assert shipped.training.server_momentum == lib.training.server_momentum == 0.0
    assert DriftConfig().detector == "paired_loss"
    # default.toml leaves the detector to the method (a file switched to "paper" then
    # runs the paper's loss threshold)
    import tomllib

    assert "detector" not in tomllib.loads((ROOT_CONFIGS / "default.toml").read_text())["drift"]


def test_the_paper_method_is_one_field_and_explicit_fields_win():
    paper = {"cohort.components": "variance", "cohort.direction_rule": "auto",
             "cohort.leading_split_alpha": None, "cohort.leading_split_family_ratio": None,
             "cohort.cosine_refinement": False, "cohort.one_component": "clusterer",
             "cohort.refit_without_outliers": False, "cohort.client_choice": False,
             "training.server_learning_rate": 1.0,
             "training.server_learning_rate_scope": "all",
             "drift.detector": "loss_threshold"}
    assert COHORT_METHODS["paper"] == paper
    cfg = validate_config({"cohort": {"method": "paper"}})
    assert _method_fields(cfg) == paper
    # a model instance as input, too
    assert _method_fields(FederationConfig(cohort=CohortConfig(method="paper"))) == paper
    # a field the config sets itself is kept; the others follow the method
    mixed = validate_config({"cohort": {"method": "paper", "components": "broken_stick"},
                             "training": {"local_epochs": 2}})
    assert _method_fields(mixed) == {**paper, "cohort.components": "broken_stick"}
    assert mixed.training.local_epochs == 2
    # the dump round-trips (every field explicit)
    assert validate_config(cfg.model_dump(mode="json")) == cfg
    # with_cohort_method writes every field of the method
    back = validate_config(with_cohort_method(default_config().model_dump(mode="json"),
                                              "paper"))
    assert back.cohort.method == "paper" and _method_fields(back) == paper
    assert validate_config(with_cohort_method(back.model_dump(mode="json"),
                                              "improved")) == default_config()
    with pytest.raises(ConfigError, match=r"cohort\.method: Input should be 'improved' or "
                                          r"'paper'"):
        validate_config({"cohort": {"method": "clma"}})
    with pytest.raises(ValueError, match="cohort.method: must be one of improved, paper"):
        with_cohort_method({}, "published")


def test_the_clma_vs_fedavg_table_runs_the_paper_method():
    cfg = load_config(ROOT_CONFIGS / "clma_vs_fedavg.toml")
    assert cfg.cohort.method == "paper"
    assert _method_fields(cfg) == COHORT_METHODS["paper"]
