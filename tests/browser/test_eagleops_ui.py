"""`eagleops ui` as a person uses it after a demo, in a fresh headless Chromium profile: both servers on free ports
(Prefect not on 4200), the printed MLflow experiments link -> the experiment -> its training runs table with the
headline columns (not MLflow's GenAI traces page), the Prefect UI answering from its own API on that port with the
flow run in its database, and Ctrl-C leaving nothing running. Screenshots under the test's tmp dir (paths printed)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from mlflow.tracking import MlflowClient

from tasks.stages.report import display_metrics, version_description
from tasks.tracking.run_logger import create_run
from tasks.tracking.views import HEADLINE_METRICS, default_tracking_uri
from tests.browser.test_mlflow_views import HEADLINE
from tests.browser.test_ui import (  # noqa: F401  (fixtures)
    body_text,
    browser,
    cut_headers,
    header_texts,
    screenshots,
    wait_for,
    wait_for_text,
)

pytestmark = pytest.mark.slow

RUN_NAME = "tiny-20261205-073352-358073"
READY = "Ctrl-C stops both servers."
START_TIMEOUT_S = 240


@pytest.fixture
def runs_root(tmp_path) -> Path:
    """A runs root as a demo leaves it: its local MLflow store with one parent run (headline metrics)."""
    root = tmp_path / "runs"
    run = create_run(default_tracking_uri(root), None, RUN_NAME,
                     {"eagleops.kind": "experiment", "eagleops.best_setting": "4/1/5"}, experiment="tiny",
                     runs_root=root, local_store=True)
    run.log_metrics(HEADLINE)
    bench = {k.removeprefix("run_benchmark."): v for k, v in HEADLINE.items() if k.startswith("run_benchmark.")}
    run.log_metrics(display_metrics(bench))  # as the report stage logs them
    # registered as the export stage does: from its child run, which holds the checkpoint (an MLflow server refuses
    # a version whose source lies in another run's artifacts)
    export = create_run(default_tracking_uri(root), None, "export_checkpoint", {"eagleops.kind": "stage"}, parent=run,
                        runs_root=root, local_store=True)
    client = MlflowClient(default_tracking_uri(root))
    client.create_registered_model("tiny-draft")
    version = client.create_model_version("tiny-draft",
                                          f"{client.get_run(export.run_id).info.artifact_uri}/checkpoint/sglang",
                                          run_id=export.run_id)
    export.finish("FINISHED")
    manifest = {"run_id": "20261205-073352-358073", "stages": {
        "run_benchmark": {"summary": {"metrics": {**bench, "accept_length_offline_depth": 4},
                                      "verdict": {"best": {"setting": "speculative 4/1/5"},
                                                  "summary": "best speculative 4/1/5: 1.61x the baseline"}}},
        "train_draft": {"summary": {"metrics": {"simulated_accept_length": 4.59}}}}}
    client.update_model_version("tiny-draft", version.version, description=version_description(
        manifest, RUN_NAME, {"Run folder": str(root / "tiny" / manifest["run_id"])}))
    run.finish("FINISHED")
    return root


@pytest.fixture
def eagleops_ui(runs_root, tmp_path):
    """`eagleops ui RUNS_ROOT` running: {label: address} it printed, and its process (stopped at the end)."""
    out = (tmp_path / "ui.out").open("w+")
    env = {**os.environ, "PREFECT_API_URL": ""}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", str(runs_root), "--prefect-home",
                             str(tmp_path / "prefect-home")], stdout=out, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True,  # SIGINT at its default, as a terminal's job has it: a suite
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # run with `&` ignores it
    deadline = time.monotonic() + START_TIMEOUT_S
    while READY not in Path(out.name).read_text():
        assert proc.poll() is None and time.monotonic() < deadline, Path(out.name).read_text()
        time.sleep(0.5)
    printed = dict(line.split(": ", 1) for line in Path(out.name).read_text().splitlines() if ": http" in line)
    yield printed, proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    out.close()


def listening(url: str) -> bool:
    parts = urlsplit(url)
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((parts.hostname, parts.port)) == 0


def metric_names(driver, names) -> list[str]:
    """Those of `names` the run page shows as text of their own, in screen order (top to bottom)."""
    script = """const names = arguments[0];
        return Array.from(document.querySelectorAll('body *'))
          .filter(e => e.children.length === 0 && names.includes(e.textContent.trim()))
          .map(e => [e.getBoundingClientRect().top, e.textContent.trim()])
          .sort((a, b) => a[0] - b[0]).map(p => p[1]);"""
    return driver.execute_script(script, list(names))


def create_flow_run(prefect: str, name: str) -> str:
    """A flow run in the server's database, as `eagleops run` leaves one (named after the experiment and setting)."""
    api = f"{prefect}/api"
    flow = post_created(f"{api}/flows/", {"name": "eagle3-experiment"})
    state = {"type": "COMPLETED", "name": "Completed"}
    return post_created(f"{api}/flow_runs/", {"flow_id": flow["id"], "name": name, "state": state})["id"]


def post_created(url: str, body: dict) -> dict:
    """POST to the Prefect API; a server error is tried again a few times, as a Prefect client would (the server's
    SQLite database may be busy on a loaded machine), and what is finally answered is shown if it is no 200/201."""
    for attempt in range(5):
        resp = httpx.post(url, json=body, timeout=30)
        if resp.status_code < 500:
            break
        time.sleep(1 + attempt)
    assert resp.status_code in (200, 201), f"POST {url}: {resp.status_code} {resp.text[:1000]}"
    return resp.json()


def test_eagleops_ui_serves_both_uis_and_its_links_land_right(eagleops_ui, browser, screenshots):
    printed, proc = eagleops_ui
    mlflow, prefect = printed["MLflow experiments"], printed["Prefect flow runs"]
    assert ":4200" not in prefect and ":5000" not in mlflow, printed
    assert f"MLflow newest run ({RUN_NAME})" in printed, printed

    # root -> experiment -> runs, as a person would at 1600 px: the bare root (MLflow's GenAI home in a fresh
    # profile, what MLflow alone controls), "Model training" once (the browser keeps it), then the experiment
    browser.set_window_size(1600, 1000)
    browser.get(mlflow.split("/#")[0] + "/")
    toggle = "//*[normalize-space()='Model training'][not(*) or self::button]"
    wait_for(browser, lambda d: d.find_elements("xpath", toggle), "the Model training switch")[0].click()
    link = "//a[normalize-space()='tiny']"
    wait_for(browser, lambda d: d.find_elements("xpath", link), "the experiment in the list")[0].click()
    wait_for(browser, lambda d: "Run Name" in header_texts(d), "the runs table")
    path = screenshots / "ui-01-mlflow-root-model-training-experiment.png"
    browser.save_screenshot(str(path))
    print(f"screenshot: {path}")
    assert "Traces" not in header_texts(browser) and "/runs" in browser.current_url, browser.current_url
    assert "No data available" not in body_text(browser)
    browser.get(printed["MLflow runs table"])  # the printed link: the headline columns, in any browser
    wait_for_text(browser, RUN_NAME[:12])
    wait_for(browser, lambda d: set(HEADLINE_METRICS[:2]) <= set(header_texts(d)), "the printed table's columns")
    assert not cut_headers(browser, HEADLINE_METRICS[:2])
    path = screenshots / "ui-02-mlflow-printed-runs-table.png"
    browser.save_screenshot(str(path))
    print(f"screenshot: {path}")

    # the parent run: its headline display figures (short names, rounded), and the version registered from it
    browser.get(printed[f"MLflow newest run ({RUN_NAME})"])
    wait_for_text(browser, "_tok_s")
    path = screenshots / "ui-03-mlflow-parent-run.png"
    browser.save_screenshot(str(path))
    print(f"screenshot: {path}")
    shown = metric_names(browser, display_metrics({k.split(".")[1]: v for k, v in HEADLINE.items()}))
    assert sorted(shown) == ["_accept_len_offline", "_accept_len_online", "_baseline_tok_s", "_speedup", "_tok_s"]

    # the model version: its description the benchmark's figures and the experiment run, its source the export run
    browser.get(printed["MLflow model tiny-draft version 1"])
    wait_for_text(browser, "1.61x the baseline")
    body = body_text(browser)
    assert "1266.8 tok/s" in body and "3.32 online vs 3.59 offline" in body and "4.59" in body, body
    assert RUN_NAME in body or "20261205-073352-358073" in body, body
    path = screenshots / "ui-04-mlflow-model-version.png"
    browser.save_screenshot(str(path))
    print(f"screenshot: {path}")
    assert "Source Run" in body and "export_checkpoint" in body  # the run holding the checkpoint, linked by MLflow
    source = "//*[normalize-space()='Source Run']/following::a[1]"
    assert "/runs/" in browser.find_element("xpath", source).get_attribute("href")

    # Prefect's UI on a port that is not 4200, asking its own API: the flow run made after the server started shows
    flow_run_id = create_flow_run(prefect.split("/v2")[0], "tiny 4/1/5")
    browser.get(prefect)
    wait_for_text(browser, "tiny 4/1/5")
    body = body_text(browser)
    assert "Unable to connect" not in body and "Can't connect" not in body, body
    path = screenshots / "ui-05-prefect-flow-runs.png"
    browser.save_screenshot(str(path))
    print(f"screenshot: {path}")
    browser.get(f"{prefect.removesuffix('/runs')}/runs/flow-run/{flow_run_id}")
    wait_for_text(browser, "tiny 4/1/5")

    # Ctrl-C (the terminal's SIGINT to the process group) stops both servers
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 30
    while (listening(mlflow) or listening(prefect)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not listening(mlflow) and not listening(prefect)
