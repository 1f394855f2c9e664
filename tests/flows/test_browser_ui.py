"""Tried as a new user would, in a real browser (headless Debian Chromium via Playwright):
a federation pauses at the privacy-budget borrow gate; the Prefect UI shows the paused
approval run with its form (approver: a choice of the policy's allow-list; approve,
reason and token, all required); the approver signs with ``clma approve ... --token-only``,
fills and submits it; the federation finishes having borrowed once, recorded with the
approver's key id. Then the MLflow UI shows the federation run with its cohort runs as
child runs, and a cohort run's lineage tags.

Screenshots are kept under ``test-artifacts/browser/`` (git-ignored)."""

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

    SHOTS.mkdir(parents=True, exist_ok=True)
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
                page.reload()
                page.get_by_text("Completed").first.wait_for(timeout=60_000)
                page.screenshot(path=str(SHOTS / "03-prefect-approval-run-completed.png"))

                # --- the decision is in the ledger, with the approver, reason and key id
                from clma.budget import PrivacyLedger, load_policy
                from clma.budget.approval_token import load_private_key

                borrows = PrivacyLedger(state / "ledger", load_policy(policy)).borrows()
                assert [(b["approved"], b["approver"], b["approver_reason"], b["approver_key_id"])
                        for b in borrows] == [
                    (1, "privacy-officer", reason, load_private_key(key)[1])]

                # --- MLflow UI: the federation run lists its cohort runs as child runs
                summary = json.loads((out / "summary.json").read_text())
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
