"""Tried as a new user would, in a real browser (headless Debian Chromium via Playwright):
a federation pauses at the privacy-budget borrow gate; the Prefect UI shows the paused
approval run with its form (approver: a choice of the policy's allow-list; approve,
reason and token, all required); the approver signs with ``clma approve ... --token-only``,
fills and submits it; the federation finishes having borrowed once, recorded with the
approver's key id. The approval run then shows the submitted decision (approver, approved,
reason) in its state message and logs. Each round run (``borrow-pause-round-<r>``) tells its
own story in the Prefect UI: its logs and a markdown and a table artifact on the round run
itself (participants band, flagged and quarantined bands, splits, every release published
or refused with its reason, the borrow decision), equal to the story derived from the
published record in ``summary.json``. Then the MLflow UI shows the federation run with its
cohort runs as child runs, and a cohort run's lineage tags.

Screenshots and the pages' text are kept under ``test-artifacts/browser/`` (git-ignored;
the test prints the folder)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

PAUSE = Path(__file__).with_name("borrow_pause.toml")
BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "test-artifacts" / "browser"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]

pytestmark = [pytest.mark.server, pytest.mark.browser, pytest.mark.slow]


def _paused_run(api: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        r = httpx.post(f"{api}/flow_runs/filter", timeout=10,
                       json={"flow_runs": {"state": {"type": {"any_": ["PAUSED"]}}}})
        r.raise_for_status()
        if r.json():
            return r.json()[0]
        assert time.monotonic() < deadline, "no paused approval run"
        time.sleep(1)


def _signed_setup(tmp_path: Path, env: dict) -> tuple[Path, Path, Path]:
    """(key file, policy, config): a key from ``clma keygen``, the shipped policy listing
    its public key, and the borrow-pause config using that policy."""
    key = tmp_path / "keys" / "privacy-officer.pem"
    r = subprocess.run([str(BIN / "clma"), "keygen", "--approver", "privacy-officer", "--out",
                        str(key)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    policy = tmp_path / "policy.toml"
    policy.write_text((ROOT / "clma" / "policy" / "privacy_policy_v3.toml").read_text()
                      + "\n" + r.stdout)
    config = tmp_path / "borrow_pause.toml"
    config.write_text(PAUSE.read_text().replace("[budget]\n", f'[budget]\npolicy = "{policy}"\n'))
    return key, policy, config


def _api(api: str, path: str, body: dict) -> list[dict]:
    r = httpx.post(f"{api}/{path}", json=body, timeout=30)
    r.raise_for_status()
    return r.json()


def _run_logs(api: str, run_id: str, needle: str, timeout: float = 60) -> list[str]:
    """The run's log messages once one contains ``needle`` (the API log handler sends in
    batches)."""
    deadline = time.monotonic() + timeout
    while True:
        logs = [lg["message"] for lg in _api(api, "logs/filter", {
            "logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_ASC"})]
        if any(needle in m for m in logs) or time.monotonic() > deadline:
            return logs
        time.sleep(1)


def _check_round_stories(api: str, summary: dict) -> dict[int, dict]:
    """Each round run of the federation carries the round's story on itself: its logs and
    a markdown and a table artifact equal to the story told from the published record
    (``summary.json``), with bands as ranges, rounded values, refusals with their reason
    and the borrow decision. Returns, per round, the run and its two artifacts."""
    from clma.release import count_band
    from tasks.story import REASONS, federation_round_line, round_story, story_artifact_key

    fed = summary["federation"]
    name, m = fed["name"], int(fed["min_cohort"])
    children = _api(api, "flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {
        "any_": [summary["prefect"]["flow_run_id"]]}}})
    runs = {int(r["name"].rsplit("-", 1)[1]): r for r in children
            if r["name"].startswith(f"{name}-round-")}
    assert sorted(runs) == [1, 2, 3] and all(r["state"]["type"] == "COMPLETED"
                                              for r in runs.values())
    key = story_artifact_key(name)
    stories: dict[int, dict] = {}
    for rec in summary["rounds"]:
        r, run = rec["round"], runs[rec["round"]]
        # 8 clients, no dropouts: all 8 take part ("5–9 clients" with m = 5)
        want = round_story(rec, federation=name, min_cohort=m,
                           participants_band=count_band(fed["clients"], m))
        arts = {a["type"]: a for a in _api(api, "artifacts/filter", {
            "artifacts": {"flow_run_id": {"any_": [run["id"]]}}})}
        assert set(arts) == {"markdown", "table"}, arts
        md, table = arts["markdown"], arts["table"]
        assert (md["key"], table["key"]) == (key, f"{key}-releases")
        assert md["data"] == want.markdown
        rows = json.loads(table["data"]) if isinstance(table["data"], str) else table["data"]
        assert rows == json.loads(json.dumps(want.rows))
        logs = _run_logs(api, run["id"], want.lines[-1])
        story_logs = [line for line in logs if line.startswith(f"round {r}: ")]
        assert story_logs == want.lines, (story_logs, want.lines)
        # what the operator reads, independently of the story's code
        text = md["data"]
        assert f"participants: 5–9 clients (cohort floor m = {m})" in text
        assert not re.search(r"minimum_to|double_to|fourfold_or|below_minimum|\d_to_\d", text)
        assert not re.search(r"\d\.\d{5,}", text), text  # rounded values
        report = rec["regional"]
        if report is not None:
            n_pub = len(report["releases"])
            refused = report["budget"]["refused"]
            assert text.count("| published |") == n_pub
            assert f"**{n_pub} published**" in text
            for plan, why in refused.items():
                metric = plan.split(".", 1)[1]
                assert any(row["metric"] == metric and row["outcome"] == "refused"
                           and row["reason"] == REASONS[why] for row in rows), (plan, rows)
                assert f"[{why}; line " in "\n".join(story_logs)
        stories[r] = {"run": run, "markdown": md, "table": table, "text": text}
    one = stories[1]["text"]
    assert "borrow for line evaluation.global of epoch 0: APPROVED by privacy-officer" in one
    assert "not released: off the regional cadence (nothing charged)" in one
    # the borrowed epsilon is spent by round 2: the global line's cap refuses the rest
    refused = {(r, p): why for r, v in enumerate(summary["rounds"], 1) if v["regional"]
               for p, why in v["regional"]["budget"]["refused"].items()}
    assert refused.get((2, "global.accuracy")) == "exceeds_line_cap", refused
    assert "| accuracy | global | refused | — |  | refused: over the budget line's cap for " \
           "this epoch |" in stories[2]["text"]
    split = [line for line in stories[3]["text"].splitlines() if line.startswith("- split: ")]
    assert len(split) == 1 and split[0].startswith("- split: cohort 0 -> "), split
    assert split[0].count(" clients") == 2  # two new cohorts, each with its band
    assert "drift flagged: 5–9 clients; quarantined: 5–9 clients" in stories[3]["text"]
    # the federation run logs too: one line per committed round, naming the round run
    fed_logs = _run_logs(api, summary["prefect"]["flow_run_id"], "round(s) run")
    assert [m for m in fed_logs if " committed: cohorts " in m] == [
        federation_round_line(rec, name) for rec in summary["rounds"]], fed_logs
    return stories


def _tab(page, name: str) -> None:
    """Open a tab of a Prefect run page (the UI's tabs are ``li.p-tab``, no ARIA role)."""
    tab = page.locator("li.p-tab", has_text=re.compile(rf"^\s*{name}\s*$")).first
    tab.wait_for(timeout=90_000)
    if "p-tab__active" not in (tab.get_attribute("class") or ""):
        tab.click(timeout=90_000)


def _choose(page, dialog, option: str) -> list[str]:
    """Pick ``option`` in the form's choice field (the UI's select: a button opening a list
    of options); returns the options offered."""
    dialog.locator(".p-select-button__icon").first.click()  # the control itself only focuses
    options = page.locator(".p-select-option")
    options.first.wait_for(timeout=30_000)
    offered = [t.strip() for t in page.locator(".p-select-option__text").all_inner_texts()]
    options.filter(has_text=re.compile(rf"^\s*{re.escape(option)}\s*$")).first.click()
    return offered


def test_approve_borrow_in_prefect_ui_and_find_cohort_runs_in_mlflow_ui(
        prefect_server, mlflow_server, make_client_env, tmp_path):
    from playwright.sync_api import sync_playwright

    shutil.rmtree(SHOTS, ignore_errors=True)  # no stale screenshot of an earlier run
    SHOTS.mkdir(parents=True)
    out, state, log = tmp_path / "out", tmp_path / "state", tmp_path / "clma.log"
    env = make_client_env(tmp_path, prefect_api=prefect_server, mlflow_uri=mlflow_server)
    key, policy, config = _signed_setup(tmp_path, env)
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            [str(BIN / "clma"), "run", "--config", str(config), "--out", str(out),
             "--state-dir", str(state), "--quiet"],
            env=env, stdout=fh, stderr=fh, start_new_session=True)
    ui = prefect_server.removesuffix("/api")
    try:
        paused = _paused_run(prefect_server, proc, log)
        assert paused["name"] == "borrow-e0-evaluation-global"
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                        args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.set_default_timeout(90_000)  # a loaded CI machine renders slowly
                page.set_default_navigation_timeout(120_000)
                # --- Prefect UI: the paused approval run and its form
                page.goto(f"{ui}/runs/flow-run/{paused['id']}")
                page.get_by_text("borrow-e0-evaluation-global").first.wait_for(timeout=90_000)
                page.get_by_role("button", name="Resume").wait_for(timeout=60_000)
                page.screenshot(path=str(SHOTS / "01-prefect-paused-approval-run.png"))
                page.get_by_role("button", name="Resume").click()
                dialog = page.get_by_role("dialog")
                dialog.wait_for(timeout=60_000)
                dialog.get_by_text("Privacy budget: borrow request").wait_for()
                (SHOTS / "approval-form.html").write_text(dialog.inner_html())
                for label in ("Approver", "Approve", "Reason", "Token"):
                    assert dialog.get_by_text(label, exact=False).count() >= 1
                form_text = dialog.inner_text()
                (SHOTS / "approval-form.txt").write_text(form_text)
                # every field required: the UI marks optional fields "(Optional)"
                assert "optional" not in form_text.lower(), form_text
                # what is decided: federation, round, the line's epoch budget, the deadline
                for needle in ("borrow-pause", "evaluation.global", "cap 1.5", "spent ",
                               "remaining ", "Deadline:", "(in 600 s)"):
                    assert needle in form_text, (needle, form_text)
                assert re.search(r"round\s+1\b", form_text), form_text
                reason = "browser test: approved in the Prefect UI"
                signed = subprocess.run(
                    [str(BIN / "clma"), "approve", paused["id"], "--approver", "privacy-officer",
                     "--key", str(key), "--reason", reason, "--token-only"],
                    env=env, capture_output=True, text=True, timeout=180)
                assert signed.returncode == 0, signed.stderr
                token = signed.stdout.strip()
                offered = _choose(page, dialog, "privacy-officer")
                assert offered == ["privacy-officer", "dpo-deputy"]  # the policy's allow-list
                toggle = dialog.get_by_role("switch")
                assert toggle.get_attribute("aria-checked") != "true"  # nothing pre-approved
                toggle.click()
                assert toggle.get_attribute("aria-checked") == "true"
                areas = dialog.locator("textarea")
                assert areas.count() == 2  # reason, token
                areas.nth(0).fill(reason)
                areas.nth(1).fill(token)
                assert "privacy-officer" in dialog.locator(".p-select-button__value").inner_text()
                page.screenshot(path=str(SHOTS / "02-prefect-approval-form-filled.png"))
                dialog.get_by_role("button", name="Submit").click()
                dialog.wait_for(state="hidden", timeout=60_000)
                assert proc.wait(timeout=400) == 0, log.read_text()[-3000:]
                gate = httpx.get(f"{prefect_server}/flow_runs/{paused['id']}", timeout=10).json()
                assert gate["state"]["type"] == "COMPLETED"
                decision = f"decision submitted: APPROVED by privacy-officer: {reason}"
                assert gate["state"]["message"].startswith(decision), gate["state"]
                assert any(m.startswith(decision) for m in
                           _run_logs(prefect_server, paused["id"], decision))
                page.reload()
                page.get_by_text("Completed").first.wait_for(timeout=60_000)
                _tab(page, "Logs")
                page.get_by_text(decision).first.wait_for(timeout=60_000)  # in the run's logs
                page.screenshot(path=str(SHOTS / "03-prefect-approval-run-completed.png"))

                # --- Prefect: each round run tells its story (logs, markdown + table)
                summary = json.loads((out / "summary.json").read_text())
                stories = _check_round_stories(prefect_server, summary)
                r1 = stories[1]["run"]
                page.goto(f"{ui}/runs/flow-run/{r1['id']}")
                page.get_by_text("borrow-pause-round-1").first.wait_for(timeout=90_000)
                _tab(page, "Logs")
                for line in ("round 1: participants: 5–9 clients (cohort floor m = 5)",
                             "round 1: borrow for line evaluation.global of epoch 0: APPROVED"
                             " by privacy-officer"):
                    page.get_by_text(line).first.wait_for(timeout=60_000)
                page.screenshot(path=str(SHOTS / "03a-prefect-round-run-logs.png"),
                                full_page=True)
                _tab(page, "Artifacts")
                art_key = stories[1]["markdown"]["key"]
                page.get_by_text(art_key, exact=True).first.wait_for(timeout=60_000)
                page.get_by_text(f"{art_key}-releases", exact=True).first.wait_for(
                    timeout=60_000)
                page.screenshot(path=str(SHOTS / "03b-prefect-round-run-artifacts.png"))
                for r, story in sorted(stories.items()):
                    page.goto(f"{ui}/artifacts/artifact/{story['markdown']['id']}")
                    page.get_by_text(f"borrow-pause: round {r}").first.wait_for(timeout=90_000)
                    page.get_by_text("participants: 5–9 clients").first.wait_for(timeout=30_000)
                    body = page.inner_text("body")
                    (SHOTS / f"round-{r}-story.txt").write_text(body)
                    n_pub = story["text"].count("| published |")
                    assert f"Releases: {n_pub} published" in body, body
                    if r == 2:
                        assert "refused: over the budget line's cap for this epoch" in body
                    page.screenshot(path=str(SHOTS / f"03c-prefect-round-{r}-story.png"),
                                    full_page=True)
                page.goto(f"{ui}/artifacts/artifact/{stories[1]['table']['id']}")
                page.get_by_text("outcome").first.wait_for(timeout=90_000)  # the table's column
                page.get_by_text("published").first.wait_for(timeout=30_000)
                page.screenshot(path=str(SHOTS / "03d-prefect-round-1-release-table.png"),
                                full_page=True)

                # --- the decision is in the ledger, with the approver, reason and key id
                from clma.budget import PrivacyLedger, load_policy
                from clma.budget.approval_token import load_private_key

                borrows = PrivacyLedger(state / "ledger", load_policy(policy)).borrows()
                assert [(b["approved"], b["approver"], b["approver_reason"], b["approver_key_id"])
                        for b in borrows] == [
                    (1, "privacy-officer", reason, load_private_key(key)[1])]

                # --- MLflow UI: the federation run lists its cohort runs as child runs
                run_id = summary["mlflow"]["run_id"]
                from mlflow import MlflowClient

                exp = MlflowClient(mlflow_server).get_run(run_id).info.experiment_id
                page.goto(f"{mlflow_server}/#/experiments/{exp}/runs/{run_id}")
                page.get_by_text("Child runs").first.wait_for(timeout=90_000)
                cohorts = sorted({"0", *summary["final_cohorts"]}, key=int)
                assert len(cohorts) == 3  # root + the two cohorts split off at round 3
                for cid in cohorts:
                    page.get_by_role("link", name=f"cohort-{cid}", exact=True).wait_for(
                        timeout=60_000)
                page.screenshot(path=str(SHOTS / "04-mlflow-federation-run-child-cohorts.png"),
                                full_page=True)
                child = cohorts[-1]
                page.get_by_role("link", name=f"cohort-{child}", exact=True).click()
                page.get_by_text("clma.cohort.parents").first.wait_for(timeout=60_000)
                page.get_by_text("clma.cohort.ancestor.0").first.wait_for(timeout=60_000)
                page.screenshot(path=str(SHOTS / "05-mlflow-cohort-run-lineage-tags.png"),
                                full_page=True)
            finally:
                browser.close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    for png in SHOTS.glob("0*.png"):
        assert png.stat().st_size > 10_000
    print(f"screenshots kept in {SHOTS}")
