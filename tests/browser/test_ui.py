"""What a person sees: the Prefect UI starts the tiny deployment from its Custom run form and shows
the run Completed; the MLflow UI lists the runs and compares two of them. Headless Debian Chromium
driven by selenium; screenshots are kept under the test's tmp dir (and $EAGLEOPS_TEST_ARTIFACTS)."""

import json
import os
import shutil
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from mlflow.tracking import MlflowClient

from tests.team_servers import wait_for_run

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
# The flags known to work on this machine kind: no GPU, no sandbox as root, and no background
# networking (the closed network otherwise refuses a burst of connections at every start).
CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
                  "--disable-dev-shm-usage", "--window-size=1400,1000"]
CONFIG = """\
experiment: browser
runs_root: {runs}
target:
  kind: tiny
data:
  num_samples: 8
deploy:
  speculative: {{num_steps: 5, eagle_topk: 1, num_draft_tokens: 6}}
  baseline: true
tracking:
  uri: {mlflow}
  experiment_name: eagleops-browser
"""
WAIT_S = 60

pytestmark = pytest.mark.slow


@pytest.fixture
def browser(tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
    from selenium.common.exceptions import WebDriverException

    if not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()):
        pytest.skip("Debian chromium + chromium-driver are not installed (make test installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={tmp_path / 'chromium-profile'}"]:
        options.add_argument(flag)
    try:
        driver = webdriver.Chrome(service=webdriver.ChromeService(str(CHROMEDRIVER)), options=options)
    except WebDriverException as error:
        pytest.skip(f"chromium did not start: {error.msg}")
    driver.set_page_load_timeout(WAIT_S)
    yield driver
    driver.quit()


@pytest.fixture
def screenshots(tmp_path):
    folder = tmp_path / "screenshots"
    folder.mkdir()
    yield folder
    keep = os.environ.get("EAGLEOPS_TEST_ARTIFACTS")
    if keep:
        shutil.copytree(folder, Path(keep) / "browser", dirs_exist_ok=True)


def wait_for(driver, condition, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.5).until(condition, message=f"waiting for {what}")


def wait_for_text(driver, text: str) -> None:
    wait_for(driver, lambda d: text in d.find_element("tag name", "body").text, f"'{text}' on {driver.current_url}")


def click_text(driver, tag: str, text: str) -> None:
    xpath = f"//{tag}[normalize-space()='{text}']"
    wait_for(driver, lambda d: d.find_elements("xpath", xpath), f"{tag} '{text}'")[0].click()


def fill_optional_int(driver, label: str, value: int) -> None:
    """A `int | None` field of Prefect's schema form: switch its type toggle to int, then type."""
    field = f"//span[normalize-space()='{label} (Optional)']/ancestor::label/parent::div/following-sibling::div"
    wait_for(driver, lambda d: d.find_elements("xpath", field), f"form field {label}")
    driver.find_element("xpath", f"{field}//button[normalize-space()='int']").click()
    box = wait_for(driver, lambda d: d.find_elements("xpath", f"{field}//input"), f"{label} input")[0]
    box.clear()
    box.send_keys(str(value))


def worker_errors(log: Path) -> str:
    lines = log.read_text().splitlines()
    return "\n".join([line for line in lines if "Error" in line or "error" in line][:20] + lines[-20:])


def deployment_run_ids(api: str, deployment_id: str) -> set[str]:
    body = {"deployments": {"id": {"any_": [deployment_id]}}}
    return {r["id"] for r in httpx.post(f"{api}/flow_runs/filter", json=body, timeout=10).json()}


def form_run_id(api: str, deployment_id: str, not_these: set[str]) -> str | None:
    """The id of the run the form submitted (not one started through the API or by earlier tests)."""
    return next(iter(deployment_run_ids(api, deployment_id) - not_these), None)


def test_prefect_custom_run_then_mlflow_runs_and_comparison(team_servers, cpu_worker, browser, screenshots, tmp_path,
                                                            request):
    api, ui = team_servers.prefect_api, team_servers.prefect_ui
    config = tmp_path / "browser.yaml"
    config.write_text(CONFIG.format(runs=tmp_path / "runs", mlflow=team_servers.mlflow))
    tiny = httpx.get(f"{api}/deployments/name/eagle3-experiment/tiny", timeout=10).json()
    # The team's defaults for this deployment: the test config, only the cheap stage.
    defaults = {"config_path": str(config), "stages": ["check_environment"]}
    assert httpx.patch(f"{api}/deployments/{tiny['id']}", json={"parameters": defaults}, timeout=10).status_code == 204
    # Shared servers: give the deployment its registered defaults back for the tests that follow.
    request.addfinalizer(lambda: httpx.patch(f"{api}/deployments/{tiny['id']}",
                                             json={"parameters": tiny["parameters"]}, timeout=10))
    # The team's experiment exists before runs start (two runs creating it at the same moment race).
    MlflowClient(team_servers.mlflow).create_experiment("eagleops-browser")
    earlier = deployment_run_ids(api, tiny["id"])  # runs other tests of this session started
    # A second run to compare with, started at once so both run side by side on the worker.
    other = httpx.post(f"{api}/deployments/{tiny['id']}/create_flow_run", timeout=30,
                       json={"parameters": {**defaults, "overrides": {"num_steps": 4}}}).json()

    browser.get(f"{ui}/deployments/deployment/{tiny['id']}")
    wait_for_text(browser, "eagle3-experiment")
    browser.save_screenshot(str(screenshots / "01-prefect-deployment.png"))
    click_text(browser, "button", "Run")
    click_text(browser, "*", "Custom run")
    wait_for_text(browser, "Parameters")
    fill_optional_int(browser, "Num Steps", 3)
    browser.save_screenshot(str(screenshots / "02-prefect-custom-run-form.png"))
    click_text(browser, "button", "Submit")
    run_id = wait_for(browser, lambda d: form_run_id(api, tiny["id"], earlier | {other["id"]}),
                      "the run the form created")
    browser.save_screenshot(str(screenshots / "03-prefect-after-submit.png"))

    run = wait_for_run(api, run_id, cpu_worker)
    assert run["state"]["type"] == "COMPLETED", worker_errors(cpu_worker)
    assert run["parameters"]["overrides"]["num_steps"] == 3  # what was typed into the form
    assert run["parameters"]["config_path"] == str(config)
    browser.get(f"{ui}/runs/flow-run/{run_id}")
    wait_for_text(browser, "Completed")
    browser.save_screenshot(str(screenshots / "04-prefect-flow-run-completed.png"))
    assert wait_for_run(api, other["id"], cpu_worker)["state"]["type"] == "COMPLETED", worker_errors(cpu_worker)

    client = MlflowClient(team_servers.mlflow)
    experiment = client.get_experiment_by_name("eagleops-browser")
    parents = {r.data.tags["prefect.flow_run_id"]: r for r in client.search_runs(
        [experiment.experiment_id], "tags.`eagleops.kind` = 'experiment'")}
    ours, theirs = parents[run_id], parents[other["id"]]

    browser.get(f"{team_servers.mlflow}/#/experiments/{experiment.experiment_id}/runs")
    wait_for_text(browser, ours.info.run_name)
    wait_for_text(browser, theirs.info.run_name)
    browser.save_screenshot(str(screenshots / "05-mlflow-runs-table.png"))

    ids = json.dumps([ours.info.run_id, theirs.info.run_id])
    browser.get(f"{team_servers.mlflow}/#/compare-runs?runs={quote(ids)}&experiments={quote(json.dumps([experiment.experiment_id]))}")
    wait_for_text(browser, "deploy.speculative.num_steps")
    body = browser.find_element("tag name", "body").text
    assert ours.info.run_name in body and theirs.info.run_name in body
    browser.save_screenshot(str(screenshots / "06-mlflow-compare-two-runs.png"))
    assert len(list(screenshots.glob("*.png"))) == 6
