"""Federation configuration: one pydantic model, loadable from TOML, validated up front.

Every value that shapes a run lives here, so that "same config + same seed" is a complete
description of a simulated federation. Invalid values fail *before* any training with one
:class:`ConfigError` whose message names the field (dotted path) and the rule it broke.

The embedded default is :func:`default_config` (the file ``clma/configs/default.toml``
shipped with the package): 60 clients in 5 regions on scikit-learn's handwritten digits,
10 rounds, concept drift into two opposite label-rotation families at rounds 4 and 7.
A config file only overrides what it names: fields it omits take the model defaults
below (e.g. 20 clients and no drift events), not the embedded default's values.
"""

from __future__ import annotations

import copy
import hashlib
import json
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from clma._validation import field_errors
from clma.drift.cusum import CusumParams
from clma.drift.input_ks import InputKSParams
from clma.drift.paired import PairedLossParams
from clma.drift.river_detectors import ADWINParams, PageHinkleyParams
from clma.drift.spec import DetectorSpec

__all__ = [
    "COHORT_METHODS",
    "CONFIG_ADDITIONS",
    "config_hash",
    "with_cohort_method",
    "with_legacy_additions",
    "without_additions",
    "ConfigError",
    "DataConfig",
    "DriftEvent",
    "DriftConfig",
    "ModelConfig",
    "TrainingConfig",
    "CohortConfig",
    "EvaluationConfig",
    "DivergenceConfig",
    "TrackingConfig",
    "OrchestrationConfig",
    "BudgetConfig",
    "DPFedAvgConfig",
    "StateConfig",
    "ScheduleConfig",
    "FederationConfig",
    "FlowerConfig",
    "TransportConfig",
    "default_config",
    "load_config",
]


class ConfigError(ValueError):
    """A configuration value broke a rule. The message names the field and the rule."""


class _Strict(BaseModel):
    # strict: no silent coercion (`clients = true` or `rounds = "10"` are errors, not 1 and
    # 10); allow_inf_nan=False: every float must be finite (an infinite loss_max or gamma
    # would otherwise pass here and fail mid-run).
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, strict=True, allow_inf_nan=False
    )


PositiveInt = Annotated[int, Field(gt=0)]
Probability = Annotated[float, Field(gt=0.0, lt=1.0)]


class DataConfig(_Strict):
    """Where the federation's data comes from and how it is divided among clients."""

    dataset: Literal["digits", "fashion_mnist", "cifar10"] = "digits"
    data_dir: str | None = Field(
        default=None, description="Folder with the dataset files (fashion_mnist, cifar10 only)."
    )
    holdout_fraction: Probability = Field(
        default=0.2, description="Fixed held-out share of the dataset (test set + probe set)."
    )
    probe_size: PositiveInt = Field(
        default=128, description="Size of the shared probe set, drawn from the held-out split."
    )
    partition: Literal["iid", "dirichlet"] = "iid"
    dirichlet_alpha: Annotated[float, Field(gt=0.0)] = 1.0
    local_eval_fraction: Probability = Field(
        default=0.25, description="Share of each client's data kept on device for evaluation."
    )
    region_partition: str | None = Field(
        default=None,
        description="Path to a region partition TOML file; None = the bundled regions_v1.toml.",
    )
    source: str | None = Field(
        default=None,
        description="The user's own data: 'package.module:function' returning (features "
        "float32 (N, ...), labels int (N,)); divided among the clients like the built-in "
        "data sets (clma/datasets/source.py). None = data.dataset.",
    )

    record_churn: Annotated[float, Field(ge=0.0, lt=1.0)] = Field(
        default=0.0,
        description="Simulation only: how much of a device's training data changes between "
        "rounds. Every round a device trains and scores on a seeded random subset of "
        "round((1 - record_churn) * n) of its n training records (at least one), a device "
        "whose records keep arriving and leaving; its evaluation records stay. 0 = the same "
        "records every round, where a drift flag comparing rounds sees no sampling noise "
        "(docs/realistic_drift.md section 8).",
    )
    probe: str | None = Field(
        default=None,
        description="The probe set of the divergence scores from a file: an .npz with a "
        "float32 array 'features' (P, ...) shaped like the data's samples. None = "
        "probe_size samples of the held-out split.",
    )

    @field_validator("source")
    @classmethod
    def _source_imports(cls, v: str | None) -> str | None:
        if v is not None:
            from clma.models.factory import import_callable

            try:
                import_callable(v, "data.source")
            except ValueError as exc:  # the location already names the field
                raise ValueError(str(exc).removeprefix("data.source: ")) from None
        return v

    @model_validator(mode="after")
    def _data_dir_needed(self) -> DataConfig:
        if self.source is None and self.dataset != "digits" and not self.data_dir:
            raise ValueError(f"data.data_dir is required when data.dataset is '{self.dataset}'")
        return self


DriftKind = Literal["label_rotation", "gaussian_noise", "rotation", "blur", "feature_scale"]


class DriftEvent(_Strict):
    """One injected drift: at ``round``, the listed clients' data change in one way.

    ``label_rotation`` is concept drift: labels y -> (y + shift) mod n_classes, where the
    sign of ``shift`` gives the family's direction (+k and -k are opposite families).
    ``gaussian_noise`` (``magnitude`` = noise std on [0, 1] pixels), ``rotation``
    (``magnitude`` = degrees), ``blur`` (``magnitude`` = Gaussian filter sigma in pixels)
    and ``feature_scale`` (every feature times ``magnitude``: a recalibrated instrument;
    any features, tabular too) are covariate drift. ``family`` names the ground-truth group for the simulation's
    adjusted-Rand-index report.
    """

    round: PositiveInt
    kind: DriftKind
    clients: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    family: str = Field(min_length=1)
    shift: int = 0
    magnitude: Annotated[float, Field(ge=0.0)] = 0.0

    @model_validator(mode="after")
    def _kind_parameters(self) -> DriftEvent:
        if self.kind == "label_rotation" and self.shift == 0:
            raise ValueError("label_rotation needs a non-zero 'shift'")
        if self.kind != "label_rotation" and self.magnitude <= 0.0:
            raise ValueError(f"{self.kind} needs a positive 'magnitude'")
        if len(set(self.clients)) != len(self.clients):
            raise ValueError("'clients' lists a client more than once")
        return self


class DriftConfig(_Strict):
    """On-device drift detection and the simulation's injected drift schedule.

    ``detector`` picks what each device runs on its own loss series (clma/drift):
    ``loss_threshold`` (CLMA Algorithm 2: a rise of more than ``gamma`` nats), ``cusum``
    (one-sided CUSUM of rises standardised by the client's own robust scale, parameters
    ``[drift.cusum]``), ``page_hinkley`` / ``adwin`` (river's detectors, parameters
    ``[drift.page_hinkley]`` / ``[drift.adwin]``; need the ``drift`` extra), ``input_ks``
    (per-feature KS tests of the device's inputs against its reference sample, Bonferroni
    corrected, or-ed with the loss threshold; parameters ``[drift.input_ks]``),
    ``paired_loss`` (the loss threshold, confirmed on the model the device received the
    round before: a rise flags only if that model also fits the current records worse, by
    more than ``[drift.paired_loss] min_data_rise`` nats, a change of the data rather than
    of the model; clma.drift.paired). The chosen
    detector's parameters travel to the devices with the round's training settings.
    """

    gamma: Annotated[float, Field(gt=0.0)] = Field(
        default=0.5,
        description="A client flags drift when its local loss rises by more than gamma (nats) "
        "over its previous round (CLMA Algorithm 2; detector = 'loss_threshold').",
    )
    detector: Literal["loss_threshold", "cusum", "page_hinkley", "adwin", "input_ks",
                      "paired_loss"] = Field(
        default="paired_loss", description="The on-device drift detector. Default (cohort."
        "method = 'improved'): 'paired_loss', the loss threshold confirmed on the model "
        "received the round before (a server step that overshoots makes clients whose data "
        "did not move see their loss rise: docs/realistic_drift.md section 8); "
        "cohort.method = 'paper': 'loss_threshold'.")
    cusum: CusumParams = Field(default_factory=CusumParams)
    page_hinkley: PageHinkleyParams = Field(default_factory=PageHinkleyParams)
    adwin: ADWINParams = Field(default_factory=ADWINParams)
    input_ks: InputKSParams = Field(default_factory=InputKSParams)
    paired_loss: PairedLossParams = Field(default_factory=PairedLossParams)
    events: list[DriftEvent] = Field(default_factory=list)

    def detector_spec(self) -> DetectorSpec:
        """The :class:`clma.drift.DetectorSpec` the devices receive."""
        params = {"cusum": self.cusum, "page_hinkley": self.page_hinkley,
                  "adwin": self.adwin, "input_ks": self.input_ks,
                  "paired_loss": self.paired_loss}.get(self.detector)
        return DetectorSpec.of(self.detector, params)


class ModelConfig(_Strict):
    """The federation's model: the built-in ReLU multilayer perceptron (``hidden``), or the
    user's own torch model from ``factory``."""

    hidden: list[Annotated[int, Field(gt=0, le=4096)]] = Field(
        default_factory=lambda: [64, 32], min_length=1, max_length=8
    )
    factory: str | None = Field(
        default=None,
        description="The user's own model: 'package.module:function' returning a "
        "torch.nn.Module (clma/models/factory.py); None = the built-in MLP of 'hidden'.",
    )

    weights: str | None = Field(
        default=None,
        description="Start from these weights: a file holding the model's state_dict "
        "(torch.save; loaded with weights_only=True, strict keys and shapes), or a cohort "
        "model CLMA registered in MLflow ('models:/name@alias', 'models:/name/version', "
        "'runs:/run_id/model'; read from MLFLOW_TRACKING_URI or the local store). None = "
        "the factory's (or the MLP's) initialisation at the federation's seed.",
    )

    @field_validator("factory")
    @classmethod
    def _factory_imports(cls, v: str | None) -> str | None:
        if v is not None:
            from clma.models.factory import import_callable

            try:
                import_callable(v, "model.factory")
            except ValueError as exc:  # the location already names the field
                raise ValueError(str(exc).removeprefix("model.factory: ")) from None
        return v


class DPFedAvgConfig(_Strict):
    """DP-FedAvg on the server (McMahan et al., ICLR 2018) with the fixed-denominator
    estimator: client updates clipped to L2 norm ``clipping_bound`` C, summed per cohort,
    Gaussian noise of std ``noise_multiplier * 2C`` (the replace-one sensitivity of the
    sum) added once, divided by the cohort's public denominator D (expected participants,
    fixed before the round). Off by default (it costs accuracy); when on, every round
    charges the ledger's training line as a sample without replacement of the clients
    (RDP accounting) and training backs off when that line is refused."""

    enabled: bool = False
    clipping_bound: Annotated[float, Field(gt=0.0, le=1e6)] = Field(
        default=1.0, description="L2 norm bound of one client's update (params - start model)."
    )
    noise_multiplier: Annotated[float, Field(gt=0.0, le=1e6)] = Field(
        default=1.0, description="z = sigma / (2 * clipping_bound): noise std on the sum of "
        "clipped updates over its replace-one L2 sensitivity."
    )
    noise_seeded: bool = Field(
        default=False,
        description="False (default): OpenDP's secure sampler. True: seeded simulation "
        "noise for experiments and tests: reproducible and NOT private (labelled on every "
        "release; refused with real clients or servers unless "
        "testing.allow_seeded_noise_not_private).",
    )


class TrainingConfig(_Strict):
    """Local training on each client: SGD for ``local_epochs`` epochs."""

    local_epochs: PositiveInt = 5
    learning_rate: Annotated[float, Field(gt=0.0, le=10.0)] = 0.3
    batch_size: PositiveInt = 16
    participation: Annotated[float, Field(gt=0.0, le=1.0)] = Field(
        default=1.0, description="Fraction of clients selected per round (seeded)."
    )
    server_learning_rate: Annotated[float, Field(gt=0.0, le=10.0)] = Field(
        default=1.5, description="Server step on each existing cohort's model: start + "
        "server_learning_rate * (aggregate - start) (FedOpt's server learning rate, Reddi "
        "et al., ICLR 2021, Algorithm 1 with SGD as the server optimizer; 1 = FedAvg). "
        "New and merged cohorts start from their members' aggregate. Under DP-FedAvg the "
        "step post-processes the noisy aggregate (no privacy cost). Default 1.5 on drift "
        "cohorts (cohort.method = 'improved'); 1.0 = FedAvg with cohort.method = 'paper'."
    )
    server_momentum: Annotated[float, Field(ge=0.0, lt=1.0)] = Field(
        default=0.0, description="Server momentum beta on the cohorts that take the server "
        "step (training.server_learning_rate_scope): velocity v = beta * c * v + (aggregate "
        "- start), model = start + server_learning_rate * v (FedAvgM, Hsu et al. 2019; SGD "
        "with momentum as FedOpt's server optimizer), the carried velocity clipped to the "
        "length of the round's change (c = min(1, |aggregate - start| / |v|)), so a step is "
        "at most server_learning_rate * (1 + beta) times the change. The velocity is kept per cohort in "
        "the server state (a new or merged cohort starts at 0) and derived from the released "
        "models, so under DP-FedAvg it is post-processing (no privacy cost). Default 0 (no "
        "momentum): 0.3 measured within the seeds' spread of it on label-skewed drift "
        "(docs/realistic_drift.md section 8); with it, set "
        "cohort.leading_split_family_ratio = 0.6 (one drift family split in two at 0.63)."
    )
    server_learning_rate_scope: Literal["all", "drift_cohorts"] = Field(
        default="drift_cohorts", description="Which cohorts take the server step: 'all' (every "
        "existing cohort) or 'drift_cohorts' (only cohorts with a parent in the cohort "
        "registry: formed from drifted clients by a split, or by a merge, so a merge with "
        "the federation's first cohort steps its clients too; parentless cohorts such as "
        "the first keep FedAvg, so until a drift event nothing changes)."
    )
    dp: DPFedAvgConfig = Field(default_factory=DPFedAvgConfig)


class BudgetConfig(_Strict):
    """The privacy-budget ledger and the borrowing gate (rules: the policy file)."""

    enabled: bool = Field(
        default=True, description="Charge every release to the ledger before noise is drawn."
    )
    state_dir: str | None = Field(
        default=None,
        description="Folder of the durable ledger (reuse it to resume a federation); "
        "None = the federation's state dir (STATE_DIR/ledger) when it has one, else "
        "OUT/ledger of the run's --out folder (started fresh by each run into that folder), "
        "else a temporary folder removed at the end of the run.",
    )
    policy: str | None = Field(
        default=None,
        description="Privacy policy TOML (a path, or the file name of a policy bundled in "
        "clma/policy/); None = clma/policy/privacy_policy_v3.toml.",
    )

    @field_validator("policy")
    @classmethod
    def _policy_loads(cls, v: str | None) -> str | None:
        """The policy must load and validate now, not when the first release is charged
        (None: the shipped default policy, validated by its own tests)."""
        if v is None:
            return v
        from clma.budget.policy import PolicyError, load_policy

        try:
            load_policy(v)
        except PolicyError as exc:
            raise ValueError(str(exc)) from None
        return v
    approval_gate: Literal["pause", "refuse"] = Field(
        default="refuse",
        description="When evaluation would overspend: 'pause' waits for a named approver "
        "(Prefect UI form or 'clma approve'); 'refuse' (unattended runs) refuses at once, "
        "recorded like a timeout, so training backs off.",
    )
    approval_timeout_seconds: PositiveInt | None = Field(
        default=None, description="Pause timeout; None = the policy's approval_timeout_seconds."
    )
    approval_poll_seconds: Annotated[float, Field(gt=0.0, le=60.0)] = Field(
        default=2.0, description="How often the paused flow checks whether it was resumed."
    )


#: The fields each ``cohort.method`` sets when the config does not set them itself (the
#: "improved" values are the fields' defaults). "paper": CLMA Algorithm 3's component rule
#: and signed-KS direction groups, FedAvg on every cohort and the loss-threshold flag
#: (CODS-COMAD 2024), with the library's centering and silhouette-chosen k; "improved":
#: broken-stick components, one group for all quarantined clients, the leading-component
#: split, FedOpt's server step on drift cohorts and the paired-loss flag
#: (docs/realistic_drift.md: what fails under label skew and why).
COHORT_METHODS: dict[str, dict[str, Any]] = {
    "improved": {"cohort.components": "broken_stick", "cohort.direction_rule": "none",
                 "cohort.leading_split_alpha": 0.01,
                 "cohort.leading_split_family_ratio": 0.7,
                 "cohort.cosine_refinement": True,
                 "cohort.one_component": "two_means",
                 "cohort.refit_without_outliers": True,
                 "cohort.client_choice": True,
                 "training.server_learning_rate": 1.5,
                 "training.server_learning_rate_scope": "drift_cohorts",
                 "drift.detector": "paired_loss"},
    "paper": {"cohort.components": "variance", "cohort.direction_rule": "auto",
              "cohort.leading_split_alpha": None,
              "cohort.leading_split_family_ratio": None,
              "cohort.cosine_refinement": False,
              "cohort.one_component": "clusterer",
              "cohort.refit_without_outliers": False,
              "cohort.client_choice": False,
              "training.server_learning_rate": 1.0,
              "training.server_learning_rate_scope": "all",
              "drift.detector": "loss_threshold"},
}


def with_cohort_method(data: Mapping[str, Any], method: str) -> dict[str, Any]:
    """A copy of the config mapping ``data`` (e.g. a ``model_dump()``) running ``method``:
    ``cohort.method`` and every field of :data:`COHORT_METHODS` set to the method's values
    (replacing values ``data`` holds). Raises ValueError for an unknown method."""
    if method not in COHORT_METHODS:
        raise ValueError(f"cohort.method: must be one of {', '.join(COHORT_METHODS)}, "
                         f"got {method!r}")
    out = copy.deepcopy(dict(data))
    out.setdefault("cohort", {})["method"] = method
    for path, value in COHORT_METHODS[method].items():
        section, leaf = path.split(".", 1)
        out.setdefault(section, {})[leaf] = value
    return out


class CohortConfig(_Strict):
    """Cohorting of quarantined clients (CLMA Algorithm 3) and cohort merging."""

    enabled: bool = Field(
        default=True,
        description="False = plain FedAvg: one global model, no quarantine (the baseline).",
    )
    method: Literal["improved", "paper"] = Field(
        default="improved",
        description="'improved' (default): broken-stick components, no KS direction split, "
        "the leading-component split (alpha 0.01) and the server step 1.5 on drift cohorts: "
        "separates drift families under label-skewed clients. 'paper': CLMA Algorithm 3's "
        "variance rule and signed-KS direction groups with FedAvg on every cohort (the "
        "CLMA-vs-FedAvg table runs it; fed-clma's paper-exact cohorter is "
        "CLMACohorter(center=False, clusterer=AutoKMeans(fixed_k=2)), whose class defaults "
        "did not change). The method fills "
        "cohort.components, cohort.direction_rule, cohort.leading_split_alpha, "
        "cohort.leading_split_family_ratio, cohort.cosine_refinement, cohort.one_component, "
        "cohort.refit_without_outliers, cohort.client_choice, "
        "training.server_learning_rate, training.server_learning_rate_scope and "
        "drift.detector ('paired_loss' / 'loss_threshold') where the config does not set "
        "them (clma.config.COHORT_METHODS).",
    )
    variance_threshold: Annotated[float, Field(gt=0.0, le=1.0)] = 0.95
    center: bool = True
    min_ks_magnitude: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    fixed_k: PositiveInt | None = None
    max_k: Annotated[int, Field(ge=2)] = 10
    min_silhouette: Annotated[float, Field(ge=-1.0, le=1.0)] = 0.25
    merge_cohorts_threshold: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    components: Literal["variance", "broken_stick"] = Field(
        default="broken_stick",
        description="Principal components kept per direction group: 'variance' = the fewest "
        "reaching variance_threshold (CLMA Algorithm 3); 'broken_stick' = those above the "
        "broken-stick expectation (separates drift families under label-skewed clients; "
        "clma.cohort.cohorter, a documented departure).",
    )
    direction_rule: Literal["auto", "established", "sign", "none"] = Field(
        default="none",
        description="Which signed-KS directions split the quarantined clients "
        "(clma.cohort.CLMACohorter): 'auto' = 'established' when centering, else 'sign' "
        "(the paper); 'none' = one group for all, used with components='broken_stick' "
        "under label-skewed clients.",
    )
    features: Literal["paper", "relative"] = Field(
        default="paper",
        description="What the cohorter compares: 'paper' = the clients' parameter vectors "
        "(CLMA Algorithm 3); 'relative' = each client's update minus the running mean of "
        "its own previous stable updates, which cancels a label-skewed client's stable "
        "component (clma.cohort.features; a documented departure).",
    )
    leading_split_alpha: Annotated[float, Field(gt=0.0, lt=1.0)] | None = Field(
        default=0.01,
        description="With components='broken_stick': a group with no component above the "
        "broken stick is split in two along its leading principal component when the "
        "exact 1-D 2-means test (clma.cohort.split, after SigClust) has p <= this level; "
        "None = off (cohort.method = 'paper'). Separates covariate-drift families (a "
        "documented departure).",
    )
    leading_split_min_size: PositiveInt = Field(
        default=5, description="Smallest group of a leading-component split (clients); a "
        "group of n < 2 * this is tested with max(2, n // 2), so small federations can "
        "split and a lone client is never split off.")
    leading_split_family_ratio: Annotated[float, Field(gt=0.0, le=1.0)] | None = Field(
        default=0.7,
        description="A significant leading-component split is undone when the mean "
        "displacement cosine across its two sides is at least this fraction of the mean "
        "within them: two magnitudes of one drift, not two drifts (measured: one family's "
        "parts 0.84-0.88, and 0.63 under training.server_momentum 0.3, two covariate "
        "families 0.13-0.53, two label families at most 0.22; docs/realistic_drift.md "
        "section 8). None = never undone (cohort.method = 'paper').",
    )
    cosine_refinement: bool = Field(
        default=True,
        description="After k-means (or one_component = 'two_means') splits a group, move each "
        "client to the part whose mean displacement (without the client) is closest in "
        "angle, over the full parameters, until none moves: spherical k-means started from "
        "the split (clma.cohort.cohorter.cosine_refine; a documented departure; leading "
        "splits are not refined, nor parts whose mean within-part cosines differ by more "
        "than 2x). False = the split as made (cohort.method = 'paper').",
    )
    one_component: Literal["clusterer", "two_means", "tested_two_means"] = Field(
        default="two_means",
        description="With components='broken_stick', a group with exactly one component "
        "above the broken stick: 'two_means' splits it in two along that component (exact "
        "1-D 2-means, groups of at least max(2, min(leading_split_min_size, n // 2)); "
        "undone like a leading split when its sides drift the same way, then refined by "
        "cosine_refinement); 'tested_two_means' does so only if that split is significant "
        "by the leading split's test at leading_split_alpha (one family's spread of drift "
        "magnitudes can lift one component above the broken stick); 'clusterer' "
        "(cohort.method = 'paper') lets k-means choose k by silhouette on the one "
        "component, which over-splits two families (docs/realistic_drift.md section 8).",
    )
    refit_without_outliers: bool = Field(
        default=True,
        description="With components='broken_stick': a client carrying more than half of "
        "a component above the broken stick, or left alone in a part by k-means (or the "
        "one-component 2-means), is set aside; the group is split again without such "
        "clients, then each joins the new part closest in angle (its own part if no cosine "
        "is positive). One outlying client took a component: k-means split 28 + 1 with both "
        "families in the 28, and a family drifting again was cut along it "
        "(docs/realistic_drift.md section 8). False = the split as made "
        "(cohort.method = 'paper').",
    )
    client_choice: bool = Field(
        default=True,
        description="After a drift round splits a cohort's quarantined clients into two or "
        "more new cohorts, each of those clients scores the new cohorts' models on all its "
        "local records and answers the id of the one with the lowest loss (IFCA's rule, "
        "applied once; the loss never leaves the device); a client choosing another cohort "
        "moves there for the next round. A client the split left alone, or the one client "
        "a split left in its old cohort, chooses between staying (scored with the model "
        "it started the round from) and every new cohort of two or more clients of the "
        "round. The moves among one source's new cohorts stand only "
        "if each of them is chosen by more than half of its own members (else one model "
        "fits everyone better, as under covariate drift, and the split stands). Mends "
        "clients whose update carries too little to "
        "cluster (docs/realistic_drift.md section 8). False = the split stands "
        "(cohort.method = 'paper').",
    )


class EvaluationConfig(_Strict):
    """Private regional evaluation (central DP on the aggregate, cohort floor)."""

    every: PositiveInt = Field(default=1, description="Evaluate every k rounds.")
    epsilon: Annotated[float, Field(gt=0.0, le=100.0)] = Field(
        default=1.0, description="Epsilon of one regional release (parallel across regions)."
    )
    min_cohort: PositiveInt = Field(
        default=3,
        description="Regions with fewer contributing clients are suppressed. The floor in "
        "force is max(min_cohort, privacy policy evaluation.minimum_group_size), so a value "
        "below the policy floor (5) is raised to it (tasks/evaluate.py).",
    )
    loss_max: Annotated[float, Field(gt=0.0)] = Field(
        default=5.0, description="Clipping bound L_max of the mean loss, in nats."
    )
    noise_seeded: bool = Field(
        default=False,
        description="False (default): OpenDP's secure sampler. True: seeded simulation "
        "noise for experiments and tests: reproducible and NOT private (labelled on every "
        "release; refused with real clients or servers unless "
        "testing.allow_seeded_noise_not_private).",
    )
    global_epsilon: Annotated[float, Field(gt=0.0, le=100.0)] | None = Field(
        default=None, description="Epsilon of the global release; None = epsilon."
    )
    health_epsilon: Annotated[float, Field(gt=0.0, le=100.0)] = Field(
        default=0.5, description="Epsilon of each round-health release (dropout rate)."
    )
    dropout_rate: Annotated[float, Field(ge=0.0, lt=1.0)] = Field(
        default=0.0,
        description="Simulated probability that a client drops out of an evaluation "
        "round's secure aggregation (seeded).",
    )
    secagg_corrupted_fraction: Annotated[float, Field(ge=0.0, lt=0.5)] = Field(
        default=0.05,
        description="Assumed fraction of clients colluding with the server (gamma): "
        "secure aggregation stays private against it with probability >= "
        "1 - 2^-secagg_statistical_security (clma.privacy.secagg).",
    )
    secagg_dropout_fraction: Annotated[float, Field(ge=0.0, lt=0.5)] = Field(
        default=0.10,
        description="Fraction of a group's clients that may drop out (delta): the secure "
        "sum completes with probability >= 1 - 2^-secagg_correctness when at most this "
        "many drop; choose it above the expected dropout rate.",
    )
    secagg_statistical_security: Annotated[int, Field(ge=20, le=128)] = Field(
        default=40, description="sigma, bits of the secure-aggregation privacy bound."
    )
    secagg_correctness: Annotated[int, Field(ge=1, le=64)] = Field(
        default=20, description="eta, bits of the secure-aggregation completion bound."
    )
    baseline_from_round: PositiveInt = Field(
        default=1,
        description="Alert baselines are recorded at the first evaluation at or after "
        "this round (earlier releases are published but not compared).",
    )
    merge_after: PositiveInt = Field(
        default=3,
        description="A region suppressed in this many consecutive evaluations is merged, "
        "for monitoring only, with the neighbour its partition file names.",
    )
    bounds_every: Annotated[int, Field(ge=0)] = Field(
        default=0,
        description="Re-derive the loss clip bound from the published global error "
        "histogram every k evaluations (0 = never).",
    )
    noise: Literal["central", "distributed"] = Field(
        default="central",
        description="central (default): the server adds Laplace noise once to each "
        "secure sum. distributed: every device adds a discrete Gaussian share to its "
        "quantised accuracy and mean-loss coordinates before masking, sized so that the "
        "sum over the fewest honest survivors a group can unmask is (epsilon, delta)-DP; "
        "the server publishes the noisy sum as is (clma.privacy.distributed).",
    )
    delta: Annotated[float, Field(gt=0.0, le=1e-3)] = Field(
        default=1e-6,
        description="Distributed mode: the delta each regional release is calibrated for "
        "(with epsilon), before the ring's wrap-around bound is added to it.",
    )

    @model_validator(mode="after")
    def _distributed_rules(self) -> EvaluationConfig:
        if self.noise == "distributed":
            if self.noise_seeded:
                raise ValueError("evaluation.noise_seeded: distributed noise is drawn on the "
                                 "devices from OpenDP and cannot be seeded; set "
                                 "noise_seeded = false with noise = \"distributed\"")
            if self.bounds_every:
                raise ValueError("evaluation.bounds_every: the error-histogram release is not "
                                 "available with noise = \"distributed\" (only accuracy and "
                                 "mean loss are noised on the devices); set bounds_every = 0")
        return self


class DivergenceConfig(_Strict):
    """Atypical-client scoring on the shared probe set (representation-level divergence).

    ``action``: what the round does with the flagged clients (robust z > ``z_threshold``):
    ``report`` (log only, aggregation unchanged), ``downweight`` (their FedAvg weight is
    multiplied by ``downweight_factor``) or ``exclude`` (FedAvg weight 0). ``signal``: whose
    flags count: ``representation`` (the default, issue 6), ``parameter`` (the leave-one-out
    cosine baseline, the stronger signal in ``clma experiment atypical-client``), ``either``
    (union) or ``both`` (intersection). Both signals are scored and logged every round
    whatever ``signal`` is. ``flag``: the rule that makes a client "flagged" for each signal
    (``one_sided`` z > ``z_threshold``, ``two_sided`` |z| > ``z_threshold``, or the default
    ``persistent``: |EWMA s of the clipped z| > ``persistence_threshold`` and |robust z of
    s across the round's clients| > ``z_threshold``, Roberts 1959; a shifted client is
    consistently atypical across rounds, in either direction; see docs/atypical_client.md
    for the measurements behind the rule and the default).
    """

    enabled: bool = True
    beta: Annotated[float, Field(ge=0.0)] = 1.0
    z_threshold: Annotated[float, Field(gt=0.0)] = 3.0
    action: Literal["report", "downweight", "exclude"] = "report"
    signal: Literal["representation", "parameter", "either", "both"] = "representation"
    flag: Literal["one_sided", "two_sided", "persistent"] = Field(
        default="persistent",
        description="Which rule flags a client (clma/divergence/flags.py): 'one_sided' "
        "z > z_threshold; 'two_sided' |z| > z_threshold; 'persistent' |EWMA of the clipped "
        "z| > persistence_threshold and |robust z of that EWMA across the round's clients| > "
        "z_threshold (s_t = lam clip(z_t) + (1 - lam) s_{t-1}, s_0 = 0).",
    )
    persistence_lambda: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = Field(
        default=0.3, description="EWMA weight of the newest round's z (flag='persistent')."
    )
    persistence_threshold: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = Field(
        default=2.0, description="|EWMA| above which a client can be persistently atypical "
        "(with its robust z across clients above z_threshold)."
    )
    persistence_clip: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = Field(
        default=3.0, description="|z| is clipped to this before it enters the EWMA (default: "
        "the default z_threshold, so one round adds at most a just-flagged round's z)."
    )
    downweight_factor: Annotated[float, Field(gt=0.0, lt=1.0)] = Field(
        default=0.5,
        description="FedAvg weight multiplier of a flagged client when action='downweight'.",
    )


class TrackingConfig(_Strict):
    """MLflow tracking. ``experiment`` None = named after the federation."""

    experiment: str | None = None
    enabled: bool = True
    lineage: bool = Field(
        default=True,
        description="One nested MLflow run per cohort (lineage tags) and the lineage graph "
        "artifact (tasks/lineage.py).",
    )
    log_models: bool = Field(
        default=True,
        description="Log each cohort's model as an MLflow model and register it with the "
        "alias cohort-<id> (needs lineage): when the cohort is created, every "
        "models_every rounds while it changes, and at the end of each flow run.",
    )
    models_every: PositiveInt = Field(
        default=5,
        description="Rounds between two logged versions of a changing cohort model "
        "(1 = every round; exporting a model costs about a second).",
    )
    dashboards: bool = Field(
        default=True,
        description="Per-metric regional dashboards (PNG) each evaluation round, in MLflow, "
        "the out folder and as Prefect artifacts (tasks/dashboards.py).",
    )


class StateConfig(_Strict):
    """Durable federation state (clma/state.py): registry, cohort models, client detector
    state, alert baselines, ledger, round counter; committed atomically after each round."""

    dir: str | None = Field(
        default=None,
        description="State directory; None = state/<name> under the working directory "
        "(used by 'clma run --resume', 'clma serve' and scheduled runs).",
    )
    keep_commits: Annotated[int, Field(ge=1, le=1000)] = Field(
        default=2, description="Committed round snapshots kept in the state directory."
    )


class ScheduleConfig(_Strict):
    """Recurring rounds for 'clma serve' (a Prefect deployment with a schedule).

    At most one of ``cron`` / ``interval_seconds``; each scheduled run advances the
    federation by ``rounds_per_run`` rounds from its durable state.
    """

    cron: str | None = Field(default=None, min_length=1, max_length=200)
    interval_seconds: Annotated[int, Field(ge=1, le=31_536_000)] | None = None
    rounds_per_run: PositiveInt = 1

    @model_validator(mode="after")
    def _one_trigger(self) -> ScheduleConfig:
        if self.cron is not None and self.interval_seconds is not None:
            raise ValueError("set at most one of 'cron' and 'interval_seconds'")
        if self.cron is not None and len(self.cron.split()) not in (5, 6):
            raise ValueError("'cron' must have 5 (or 6) space-separated fields")
        return self


class OrchestrationConfig(_Strict):
    """How Prefect runs the round's client work."""

    chunk_size: PositiveInt = Field(
        default=8, description="Clients per training call of the transport: one mapped "
        "train-clients task per chunk for Dask and Flower clients; in-process clients train "
        "the chunks in order in one task."
    )
    dask_address: str | None = Field(
        default=None, min_length=1,
        description="Run client training/evaluation tasks on this Dask scheduler "
        "(e.g. 'tcp://10.0.0.5:8786'; needs the 'dask' extra). None = thread pool.",
    )
    dask_local_workers: PositiveInt | None = Field(
        default=None,
        description="Start a temporary local Dask cluster with this many worker processes "
        "(one thread each) for the client tasks. None = no local cluster.",
    )

    @model_validator(mode="after")
    def _one_dask_target(self) -> OrchestrationConfig:
        if self.dask_address is not None and self.dask_local_workers is not None:
            raise ValueError("set at most one of dask_address and dask_local_workers")
        return self


def _check_address(v: str) -> str:
    """``host:port`` (IPv6 hosts in brackets), port 1..65535, no URL scheme."""
    if "://" in v:
        raise ValueError("must be host:port without a URL scheme (e.g. '127.0.0.1:9093')")
    host, sep, port = v.rpartition(":")
    if not sep or not host or host in ("[]",):
        raise ValueError("must be host:port (e.g. '127.0.0.1:9093')")
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise ValueError("an IPv6 host must be written in brackets, e.g. '[::1]:9093'")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError("port must be an integer in 1..65535")
    return v


class FlowerConfig(_Strict):
    """How the server reaches real clients on Flower's deployment engine
    (``federation.transport = "flower"``; see docs/operating.md, "Real clients").

    ``clma run`` submits the project's ServerApp (``app_dir``) to the SuperLink at
    ``superlink`` with ``flwr run``; inside it the Prefect flow reaches the SuperNodes
    through the Flower transport (:mod:`clma.flower.transport`).
    """

    superlink: str = Field(
        default="127.0.0.1:9093",
        description="host:port of the SuperLink's API (flwr 1.42 serves the Control, "
        "Fleet and Runtime APIs on one port: flower-superlink --port).",
    )
    insecure: bool = Field(
        default=False,
        description="True: plain HTTP (loopback trials only); False: TLS, verified with "
        "root_certificates (or the system's trusted CAs when unset).",
    )
    root_certificates: str | None = Field(
        default=None, min_length=1,
        description="PEM file of the CA that signed the SuperLink's certificate (TLS only).",
    )
    app_dir: str | None = Field(
        default=None, min_length=1,
        description="The Flower app folder to run (its pyproject.toml names the ServerApp "
        "and ClientApp); None = the app shipped in clma/flower/app.",
    )
    node_count: PositiveInt | None = Field(
        default=None,
        description="SuperNodes to wait for before the first round; None = 'clients'.",
    )
    timeout_seconds: Annotated[float, Field(gt=0.0, le=86_400.0)] = Field(
        default=600.0,
        description="How long one exchange waits for the nodes' replies; a node that has "
        "not answered by then is a dropout of that step.",
    )
    connect_timeout_seconds: Annotated[float, Field(gt=0.0, le=86_400.0)] = Field(
        default=300.0,
        description="How long to wait for node_count SuperNodes to connect; after it the "
        "federation starts with the nodes that answered the roster query.",
    )

    @field_validator("superlink")
    @classmethod
    def _superlink(cls, v: str) -> str:
        return _check_address(v)

    @model_validator(mode="after")
    def _tls(self) -> FlowerConfig:
        if self.insecure and self.root_certificates is not None:
            raise ValueError("root_certificates: only used with insecure = false (TLS)")
        return self


class TransportConfig(_Strict):
    """Which transport carries the round to the clients (the ``Clients`` seam,
    :mod:`clma.engine.clients`), and where simulated devices keep their own state.

    ``transport``: ``simulation`` (in-process simulated clients; the default), ``dask``
    (simulated clients hosted by Dask workers; needs ``orchestration.dask_address`` or
    ``orchestration.dask_local_workers``; unset with either of those given means
    ``dask``) or ``flower`` (real clients: Flower SuperNodes on Flower's deployment
    engine; connection in ``[federation.flower]``, :class:`FlowerConfig`).
    """

    transport: Literal["simulation", "dask", "flower"] | None = None
    device_state_dir: str | None = Field(
        default=None, min_length=1,
        description="Simulated devices' own storage (their drift detector state), never "
        "inside the server's state folder. None = '<state dir>.devices' when the federation "
        "has a state dir, else memory only.",
    )
    flower: FlowerConfig | None = Field(
        default=None,
        description="The SuperLink connection of the 'flower' transport (defaults when "
        "unset).",
    )


class ForTestingConfig(_Strict):
    """Settings that exist for tests only. Never set them in production."""

    allow_seeded_noise_not_private: bool = Field(
        default=False,
        description="TESTING ONLY: let seeded noise (evaluation.noise_seeded / "
        "training.dp.noise_seeded: reproducible, NOT private) run with the Flower transport "
        "or a configured Prefect server; the equality tests of a real deployment need it.",
    )


#: Config fields added after the first release (0.1.0 at 6015c7a), oldest first, each
#: with the value that reproduces how a federation ran before the field existed (a literal,
#: not the field's default: if a default later changes, the two differ and a stored federation
#: from before the field is refused rather than resumed under the new default). A state folder
#: written before a field existed has no value for it; it may be resumed iff the resuming
#: config keeps the field at this value. Every field added to the schema is registered here
#: (tests/clma/test_state.py checks the schema against the fields of the first release).
#: Used by :meth:`FederationConfig.fingerprint` and :func:`clma.state.resume_fingerprint`.
CONFIG_ADDITIONS: tuple[tuple[str, Any], ...] = (
    ("drift.input_ks", {"alpha": 0.01, "reference_size": 256, "summaries": True,
                        "with_loss_threshold": True}),
    ("cohort.leading_split_alpha", None),
    ("cohort.leading_split_min_size", 5),
    ("training.server_learning_rate", 1.0),
    ("training.server_learning_rate_scope", "all"),
    ("model.factory", None),
    ("data.source", None),
    ("model.weights", None),
    ("data.probe", None),
    # issue 46: the default method became "improved"; a federation from before ran the paper
    # method's fields (components, direction_rule: explicit in every stored config)
    ("cohort.method", "paper"),
    ("cohort.leading_split_family_ratio", None),
    ("cohort.cosine_refinement", False),
    ("cohort.one_component", "clusterer"),
    ("cohort.refit_without_outliers", False),
    ("cohort.client_choice", False),
    ("drift.paired_loss", {"min_data_rise": 0.1}),
    ("training.server_momentum", 0.0),
    ("data.record_churn", 0.0),
)

def config_hash(data: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of ``data`` (sorted keys, no spaces)."""
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def with_legacy_additions(data: Mapping[str, Any],
                          additions: tuple[tuple[str, Any], ...] | None = None
                          ) -> dict[str, Any]:
    """A copy of the config dump ``data`` (e.g. a state folder's ``config.json``) where
    every field of ``additions`` (default :data:`CONFIG_ADDITIONS`) it lacks holds its
    legacy value: the config a federation written before those fields ran under, not
    today's defaults (which may differ: ``cohort.method``)."""
    out = json.loads(json.dumps(dict(data)))
    for path, legacy in CONFIG_ADDITIONS if additions is None else additions:
        *parents, leaf = path.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.setdefault(leaf, json.loads(json.dumps(legacy)))
    return out


def without_additions(data: dict[str, Any], additions: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """``data`` without each of ``additions`` whose value equals its legacy value."""
    out = json.loads(json.dumps(data))
    for path, legacy in additions:
        *parents, leaf = path.split(".")
        node = out
        for p in parents:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict) and leaf in node and node[leaf] == legacy:
            del node[leaf]
    return out


class FederationConfig(_Strict):
    """The whole federation. Load with :func:`load_config`; every field has a default."""

    name: str = Field(default="clma-digits", min_length=1, max_length=100)
    seed: Annotated[int, Field(ge=0, lt=2**32)] = 0
    rounds: PositiveInt = 10
    clients: PositiveInt = 20
    data: DataConfig = Field(default_factory=DataConfig)
    drift: DriftConfig = Field(default_factory=DriftConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    cohort: CohortConfig = Field(default_factory=CohortConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    divergence: DivergenceConfig = Field(default_factory=DivergenceConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    orchestration: OrchestrationConfig = Field(default_factory=OrchestrationConfig)
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    state: StateConfig = Field(default_factory=StateConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    federation: TransportConfig = Field(default_factory=TransportConfig)
    testing: ForTestingConfig = Field(default_factory=ForTestingConfig)

    @model_validator(mode="before")
    @classmethod
    def _cohort_method(cls, data: Any) -> Any:
        """``cohort.method`` fills the fields of :data:`COHORT_METHODS` the config leaves
        unset ("improved": the fields' defaults; "paper": the published method's)."""
        if not isinstance(data, Mapping):
            return data
        cohort = data.get("cohort")
        method = (cohort.method if isinstance(cohort, CohortConfig)
                  else cohort.get("method") if isinstance(cohort, Mapping) else None)
        if method != "paper":
            return data
        out = dict(data)
        for section in ("cohort", "training", "drift"):
            values = {k.split(".", 1)[1]: v for k, v in COHORT_METHODS["paper"].items()
                      if k.startswith(section + ".")}
            given = out.get(section)
            if isinstance(given, BaseModel):
                unset = {k: v for k, v in values.items() if k not in given.model_fields_set}
                out[section] = given.model_copy(update=unset)
            elif given is None or isinstance(given, Mapping):
                out[section] = {**values, **dict(given or {})}
        return out

    @property
    def seeded_noise(self) -> bool:
        """Whether any release of this federation draws seeded (NOT private) noise."""
        return self.evaluation.noise_seeded or (self.training.dp.enabled
                                                and self.training.dp.noise_seeded)

    def seeded_noise_refusal(self, *, real_server: bool, real_clients: bool = False
                             ) -> str | None:
        """Why this config may not run here (None: it may): seeded noise with the Flower
        transport (real clients; also ``real_clients``: a Flower strategy of
        :mod:`clma.flower`, whatever ``federation.transport`` says) or a real Prefect server
        (``real_server``), unless ``testing.allow_seeded_noise_not_private``."""
        if not self.seeded_noise or self.testing.allow_seeded_noise_not_private:
            return None
        where = ("the flower transport (real clients)"
                 if real_clients or self.transport == "flower"
                 else "a configured Prefect server (PREFECT_API_URL)" if real_server else None)
        if where is None:
            return None
        return (f"evaluation.noise_seeded / training.dp.noise_seeded: seeded noise is "
                f"reproducible and NOT private, and is refused with {where}; set "
                "testing.allow_seeded_noise_not_private = true only in tests")

    @property
    def transport(self) -> str:
        """The transport in force: ``federation.transport``, or ``dask`` when a Dask target
        is configured and the transport is unset, else ``simulation``."""
        t = self.federation.transport
        if t is not None:
            return t
        o = self.orchestration
        return "dask" if (o.dask_address or o.dask_local_workers) else "simulation"

    @property
    def flower(self) -> FlowerConfig:
        """The Flower connection in force (``federation.flower`` or its defaults)."""
        return self.federation.flower if self.federation.flower is not None else FlowerConfig()

    @field_validator("name")
    @classmethod
    def _name_chars(cls, v: str) -> str:
        allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
        if not set(v) <= allowed:
            raise ValueError("may contain only letters, digits, '-', '_' and '.'")
        return v

    @model_validator(mode="after")
    def _schedule_fits(self) -> FederationConfig:
        o = self.orchestration
        if self.federation.transport == "dask" and not (o.dask_address or o.dask_local_workers):
            raise ValueError("federation.transport = 'dask' needs orchestration.dask_address "
                             "or orchestration.dask_local_workers")
        if self.federation.transport in ("simulation", "flower") and (
                o.dask_address or o.dask_local_workers):
            raise ValueError(f"federation.transport = {self.federation.transport!r}: "
                             "orchestration.dask_* only apply to the 'dask' transport")
        if self.federation.flower is not None and self.transport != "flower":
            raise ValueError("federation.flower: only applies to federation.transport = "
                             "'flower'")
        if self.transport == "flower":
            fl = self.flower
            if self.data.source is not None:
                raise ValueError("data.source: on the 'flower' transport each device's data "
                                 "come from its SuperNode's node config data-source; the "
                                 "server reads none (remove data.source)")
            if self.model.factory is not None and self.data.probe is None:
                raise ValueError("data.probe: a federation of real clients with "
                                 "model.factory needs a probe file (the server holds none "
                                 "of the devices' data)")
            if fl.node_count is not None and fl.node_count > self.clients:
                raise ValueError(f"federation.flower.node_count: at most 'clients' "
                                 f"({self.clients}); each node is one client (its partition id)")
            if self.evaluation.dropout_rate > 0.0:
                raise ValueError("evaluation.dropout_rate: simulates dropouts of in-process "
                                 "clients; on the 'flower' transport dropouts are real (set 0)")
        for i, ev in enumerate(self.drift.events):
            if ev.round > self.rounds:
                raise ValueError(
                    f"drift.events[{i}].round is beyond 'rounds' ({self.rounds}); "
                    "a drift event must happen during the run"
                )
            bad = [c for c in ev.clients if c >= self.clients]
            if bad:
                raise ValueError(
                    f"drift.events[{i}].clients names client ids >= 'clients' "
                    f"({self.clients}); client ids run from 0 to clients - 1"
                )
        seen: dict[tuple[int, int], int] = {}
        for i, ev in enumerate(self.drift.events):
            for c in ev.clients:
                if (ev.round, c) in seen:
                    raise ValueError(
                        f"drift.events[{i}] drifts client {c} at round {ev.round}, which "
                        f"drift.events[{seen[(ev.round, c)]}] already does"
                    )
                seen[(ev.round, c)] = i
        return self

    def with_overrides(self, **overrides: Any) -> FederationConfig:
        """A validated copy with top-level fields replaced (e.g. ``rounds=3``).

        Drift events that fall outside a smaller federation are dropped (clients) or
        rejected (rounds), so that ``--clients`` / ``--rounds`` on the command line behave
        predictably. Raises :class:`ConfigError`.
        """
        data = self.model_dump()
        clean = {k: v for k, v in overrides.items() if v is not None}
        data.update(clean)
        if "clients" in clean:
            events = []
            for ev in data["drift"]["events"]:
                kept = [c for c in ev["clients"] if c < clean["clients"]]
                if kept:
                    events.append({**ev, "clients": kept})
            data["drift"]["events"] = events
        if "rounds" in clean:
            data["drift"]["events"] = [
                ev for ev in data["drift"]["events"] if ev["round"] <= clean["rounds"]
            ]
        return validate_config(data)

    def fingerprint(self) -> str:
        """SHA-256 (hex) of the canonical JSON of the config, identifying a federation's
        setup across versions: each field of :data:`CONFIG_ADDITIONS` that keeps its legacy
        value is left out, so a config that sets nothing new has the fingerprint the first
        release gave it."""
        return config_hash(without_additions(self.model_dump(mode="json"), CONFIG_ADDITIONS))

    def earlier_fingerprints(self) -> set[str]:
        """The fingerprints earlier versions gave this config: they hashed their whole dump,
        which held the first ``i`` additions of :data:`CONFIG_ADDITIONS` (for every ``i``)
        and none after (for caches of finished runs written before this scheme)."""
        data = self.model_dump(mode="json")
        return {config_hash(without_additions(data, CONFIG_ADDITIONS[i:]))
                for i in range(len(CONFIG_ADDITIONS) + 1)}

    def flat_params(self) -> dict[str, str]:
        """The config flattened to dotted keys with string values (for MLflow params)."""
        out: dict[str, str] = {}

        def walk(prefix: str, obj: Any) -> None:
            if isinstance(obj, Mapping):
                for k, v in obj.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
            elif isinstance(obj, list) and obj and isinstance(obj[0], Mapping):
                out[prefix] = json.dumps(obj, sort_keys=True)[:6000]
            else:
                out[prefix] = json.dumps(obj) if not isinstance(obj, str) else obj

        walk("", self.model_dump(mode="json"))
        return out


def _format_error(err: ValidationError) -> str:
    lines = [
        f"{loc}: "
        + ("unknown field (not part of the configuration schema)"
           if kind == "extra_forbidden" else msg)
        for loc, msg, kind in field_errors(err, "(config)")
    ]
    return "invalid configuration: " + "; ".join(lines)


def validate_config(data: Mapping[str, Any]) -> FederationConfig:
    """Validate a mapping into a :class:`FederationConfig`. Raises :class:`ConfigError`."""
    try:
        return FederationConfig.model_validate(dict(data))
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def load_config(path: str | Path | None = None) -> FederationConfig:
    """Load and validate a TOML config file; None gives :func:`default_config`.

    Raises :class:`ConfigError` for an unreadable file, bad TOML, or a value that breaks a
    rule (the message names the field).
    """
    if path is None:
        return default_config()
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
    return validate_config(data)


def default_config() -> FederationConfig:
    """The embedded default federation (``clma/configs/default.toml``)."""
    text = resources.files("clma.configs").joinpath("default.toml").read_text("utf-8")
    return validate_config(tomllib.loads(text))
