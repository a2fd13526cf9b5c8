"""What a person sees, in a fresh headless Chromium profile each test (Debian chromium driven by selenium), on the
team's servers: a run started from the Custom run form of Prefect's default UI, its flow run and its MLflow run
linking to each other, the experiment page with the headline columns right after that run, its draft in the model
registry, and two runs compared. Screenshots are kept under the test's tmp dir (and $EAGLEOPS_TEST_ARTIFACTS)."""

import json
import os
import shutil
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from mlflow.tracking import MlflowClient

from tasks.runner.stages import STAGES
from tasks.tracking.views import HEADLINE_METRICS, model_version_url, run_links
from tests.helpers import TEST_TARGET_YAML, free_port
from tests.team_servers import wait_for_run

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
# The flags known to work on this machine kind: no GPU, no sandbox as root, and no background
# networking (the closed network otherwise refuses a burst of connections at every start).
CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
                  "--disable-dev-shm-usage", "--window-size=1920,1080"]
# A demo-sized run through every stage, the draft registered (the demo's export section does the same).
CONFIG = """\
experiment: browser
runs_root: {runs}
{target}data:
  num_samples: 12
  max_length: 160
  validation_fraction: 0.25
  draft_vocab_size: 64
  regenerate: {{max_new_tokens: 16}}
train: {{ttt_steps: 2, epochs: 3, max_steps: 6, batch_size: 4, log_every: 1}}
export: {{formats: [sglang], dtype: float32, registered_model: browser-draft}}
deploy:
  port: {port}
  speculative: {{num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}}
  startup_timeout_s: 240
  baseline: true
bench: {{num_prompts: 2, max_new_tokens: 8, warmup_runs: 0, timed_runs: 1}}
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
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # A condition that met an element the page re-rendered meanwhile is asked again, not failed (a full run at
    # 1920 px once hit StaleElementReferenceException right after the 07 screenshot, Prefect's artifact page).
    return WebDriverWait(driver, WAIT_S, poll_frequency=0.5, ignored_exceptions=[StaleElementReferenceException]
                         ).until(condition, message=f"waiting for {what}")


def wait_for_text(driver, text: str) -> None:
    wait_for(driver, lambda d: text in d.find_element("tag name", "body").text, f"'{text}' on {driver.current_url}")


def click_text(driver, tag: str, text: str) -> None:
    xpath = f"//{tag}[normalize-space()='{text}']"
    wait_for(driver, lambda d: d.find_elements("xpath", xpath), f"{tag} '{text}'")[0].click()


def select_tab(driver, name: str) -> None:
    """Click the tab `name` until it is the selected one: a click on a tab while Prefect's page still loads its
    panels can be lost (a CI full run once waited 60 s for the Artifacts tab's card after one click)."""
    xpath = f"//button[@role='tab'][normalize-space()='{name}']"

    def selected(d) -> bool:
        tabs = d.find_elements("xpath", xpath)
        if tabs and tabs[0].get_attribute("aria-selected") != "true":
            tabs[0].click()
        return bool(tabs) and tabs[0].get_attribute("aria-selected") == "true"

    wait_for(driver, selected, f"the {name} tab selected")


def fill_field(driver, label: str, value: int | str) -> None:
    """Type into a field of Prefect's UI v2 form: its <label for=ID> reads "<label> (Optional)"."""
    xpath = f"//label[normalize-space()='{label} (Optional)']"
    found = wait_for(driver, lambda d: d.find_elements("xpath", xpath), f"form field {label}")[0]
    box = driver.find_element("id", found.get_attribute("for"))
    box.clear()
    box.send_keys(str(value))


def body_text(driver) -> str:
    return driver.find_element("tag name", "body").text


def follow_new_tab(driver, css: str) -> None:
    """Click the link `css` finds, one that opens in a new tab (MLflow's description links do), as a user would
    (`clicked_as_a_user`), and continue in that tab."""
    before = set(driver.window_handles)
    wait_for(driver, lambda d: clicked_as_a_user(d, css), f"a click on {css} to reach it")
    new = wait_for(driver, lambda d: set(d.window_handles) - before, "the tab the link opens")
    driver.switch_to.window(new.pop())


# The "Show more" under the MLflow description holding the element (a sibling of the collapsed box around it).
EXPAND_DESCRIPTION = ("./ancestor::*[*[@data-testid='show-comment-toggle']][1]"
                      "/*[@data-testid='show-comment-toggle'][@aria-label='Expand description']")


def clicked_as_a_user(driver, css: str) -> bool:
    """Click what `css` finds; False (call again) while it is not there or something covers it. MLflow shows a long
    run description collapsed, its last lines under a gradient (data-testid truncation-gradient) that takes a click
    there (the Prefect link at 1920 px, in some runs): as a user would, the description's "Show more" is clicked
    first. The click stays WebDriver's, refused where a user's would land on something else."""
    from selenium.common.exceptions import ElementClickInterceptedException

    found = driver.find_elements("css selector", css)
    if not found:
        return False
    try:
        for toggle in found[0].find_elements("xpath", EXPAND_DESCRIPTION):
            toggle.click()
        found[0].click()
    except ElementClickInterceptedException:
        return False
    return True


def worker_errors(log: Path) -> str:
    lines = log.read_text().splitlines()
    return "\n".join([line for line in lines if "Error" in line or "error" in line][:20] + lines[-20:])


def artifact_keys(api: str, flow_run_id: str) -> list[str]:
    body = {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}, "type": {"not_any_": ["result"]}}}
    return [a["key"] for a in httpx.post(f"{api}/artifacts/filter", json=body, timeout=10).json()]


def deployment_run_ids(api: str, deployment_id: str) -> set[str]:
    body = {"deployments": {"id": {"any_": [deployment_id]}}}
    return {r["id"] for r in httpx.post(f"{api}/flow_runs/filter", json=body, timeout=10).json()}


def form_run_id(api: str, deployment_id: str, not_these: set[str]) -> str | None:
    """The id of the run the form submitted (not one started through the API or by earlier tests)."""
    return next(iter(deployment_run_ids(api, deployment_id) - not_these), None)


NONE_BRANCH = 'Property is type "None"'  # what Prefect's form shows for a None toggle instead of an input


def assert_custom_run_form_reads_right(driver) -> None:
    """Titled toggles for the config, every stage chosen, inputs (not None toggles) for the optional fields:
    only the sweep variant keeps a None toggle ("not a sweep")."""
    body = body_text(driver)
    assert "shipped config" in body and "path on the worker" in body, body
    assert body.count(NONE_BRANCH) == 1 and "not a sweep" in body, body
    assert all(stage in body for stage in ("check_environment", "train_draft", "run_benchmark", "report")), body


def test_prefect_custom_run_links_both_ways_and_lands_in_mlflow(team_servers, cpu_worker, browser, screenshots,
                                                               tmp_path, request):
    api, mlflow_ui = team_servers.prefect_api, team_servers.mlflow
    config = tmp_path / "browser.yaml"
    config.write_text(CONFIG.format(runs=tmp_path / "runs", target=TEST_TARGET_YAML, port=free_port(), mlflow=mlflow_ui))
    tiny = httpx.get(f"{api}/deployments/name/eagle3-experiment/tiny", timeout=10).json()
    # The team's default for this deployment: the test config (the form then runs every stage).
    assert httpx.patch(f"{api}/deployments/{tiny['id']}", json={"parameters": {"config_path": str(config)}},
                       timeout=10).status_code == 204
    # Shared servers: give the deployment its registered defaults back for the tests that follow.
    request.addfinalizer(lambda: httpx.patch(f"{api}/deployments/{tiny['id']}",
                                             json={"parameters": tiny["parameters"]}, timeout=10))
    # The team's experiment exists before runs start (two runs creating it at the same moment race).
    MlflowClient(mlflow_ui).create_experiment("eagleops-browser")
    earlier = deployment_run_ids(api, tiny["id"])  # runs other tests of this session started
    # A second, cheap run to compare with, started at once so both run side by side on the worker.
    other = httpx.post(f"{api}/deployments/{tiny['id']}/create_flow_run", timeout=30, json={
        "parameters": {"config_path": str(config), "stages": ["check_environment"], "overrides": {"num_steps": 4}}}).json()

    run_id = submit_custom_run(browser, screenshots, team_servers, tiny["id"], earlier | {other["id"]})
    run = wait_for_run(api, run_id, cpu_worker)
    assert run["state"]["type"] == "COMPLETED", worker_errors(cpu_worker)
    # what was typed, and what the untouched form sent: the config path, every stage, no run folder
    assert (run["parameters"]["overrides"]["num_steps"], run["parameters"]["overrides"]["num_draft_tokens"]) == (2, 3)
    assert run["parameters"]["config_path"] == str(config) and run["parameters"]["stages"] == STAGES
    assert run["name"] == "browser 2/1/3"  # the experiment and the setting, not a random name
    assert wait_for_run(api, other["id"], cpu_worker)["state"]["type"] == "COMPLETED", worker_errors(cpu_worker)

    client = MlflowClient(mlflow_ui)
    experiment = client.get_experiment_by_name("eagleops-browser")
    parents = {r.data.tags["prefect.flow_run_id"]: r for r in client.search_runs(
        [experiment.experiment_id], "tags.`eagleops.kind` = 'experiment'")}
    ours, theirs = parents[run_id], parents[other["id"]]
    links = run_links(mlflow_ui, ours.info.run_id)
    # What the UI is to show, asked of the API first: a missing artifact is the pipeline's fault, not the page's.
    assert "browser-mlflow-run" in artifact_keys(api, run_id), worker_errors(cpu_worker)
    assert_runs_table_shows_the_headline(browser, screenshots, links, ours)
    follow_the_links_both_ways(browser, screenshots, team_servers.prefect_ui, links, ours, run_id)

    # The draft the run registered, on the registry's page.
    (version,) = client.search_model_versions("name = 'browser-draft'")
    assert client.get_run(version.run_id).data.tags["mlflow.parentRunId"] == ours.info.run_id
    browser.get(model_version_url(mlflow_ui, "browser-draft", version.version))
    wait_for_text(browser, f"Version {version.version}")
    browser.save_screenshot(str(screenshots / "09-mlflow-registered-draft.png"))

    ids = json.dumps([ours.info.run_id, theirs.info.run_id])
    browser.get(f"{mlflow_ui}/#/compare-runs?runs={quote(ids)}&experiments={quote(json.dumps([experiment.experiment_id]))}")
    wait_for_text(browser, "deploy.speculative.num_steps")
    body = body_text(browser)
    assert ours.info.run_name in body and theirs.info.run_name in body
    browser.save_screenshot(str(screenshots / "10-mlflow-compare-two-runs.png"))
    assert len(list(screenshots.glob("*.png"))) == 10


def submit_custom_run(driver, screenshots: Path, servers, deployment_id: str, not_these: set[str]) -> str:
    """Check the Custom run form in both UIs, then fill and submit it in the default one; the new run's id."""
    # UI v1 (the old one, still served at /) renders the same form readably.
    driver.get(f"{servers.prefect_ui}/deployments/deployment/{deployment_id}/run")
    wait_for_text(driver, "path on the worker")
    assert_custom_run_form_reads_right(driver)
    # The UI a new user lands on: Prefect 3.9 redirects / to v2.
    driver.get(servers.prefect_ui)
    wait_for(driver, lambda d: "/v2" in d.current_url, "the redirect to Prefect's default UI")
    driver.get(f"{servers.prefect_ui}/v2/deployments/deployment/{deployment_id}")
    wait_for_text(driver, "eagle3-experiment")
    driver.save_screenshot(str(screenshots / "01-prefect-deployment.png"))
    click_text(driver, "button", "Run")
    click_text(driver, "*", "Custom run")
    wait_for_text(driver, "path on the worker")
    assert_custom_run_form_reads_right(driver)
    fill_field(driver, "Num Steps", 2)
    fill_field(driver, "Num Draft Tokens", 3)
    driver.save_screenshot(str(screenshots / "02-prefect-custom-run-form.png"))
    click_text(driver, "button", "Submit")
    run_id = wait_for(driver, lambda d: form_run_id(servers.prefect_api, deployment_id, not_these),
                      "the run the form created")
    driver.save_screenshot(str(screenshots / "03-prefect-after-submit.png"))
    return run_id


def assert_runs_table_shows_the_headline(driver, screenshots: Path, links: dict[str, str], ours) -> None:
    """Right after the run, in this fresh profile: the printed experiment link opens the training runs table with
    tok/s, speedup and both accept lengths as columns, holding this run's figures."""
    driver.get(links["experiment"])
    wait_for_text(driver, ours.info.run_name)
    wait_for(driver, lambda d: set(HEADLINE_METRICS[:4]) <= set(header_texts(d)), "the headline metric columns")
    driver.save_screenshot(str(screenshots / "04-mlflow-experiment-after-the-run.png"))
    assert not cut_headers(driver, HEADLINE_METRICS[:4])  # read whole, not "run_benchmark..." four times
    assert "Model training" in body_text(driver) and "Evaluation runs" not in body_text(driver)
    name = f"//div[@role='row'][.//a[normalize-space()='{ours.info.run_name}']]"
    row = wait_for(driver, lambda d: d.find_elements("xpath", name), "our run's row")[0].get_attribute("row-index")
    for metric in HEADLINE_METRICS[:4]:
        cell = driver.find_element("css selector", f"[row-index='{row}'] [col-id='metrics.`{metric}`']")
        assert float(cell.text) == pytest.approx(ours.data.metrics[metric], abs=0.01), (metric, cell.text)


def follow_the_links_both_ways(driver, screenshots: Path, prefect_ui: str, links: dict[str, str], ours,
                               run_id: str) -> None:
    """MLflow run -> its Prefect flow run (the description's link, in Prefect's default UI) -> the flow run's link
    artifact -> the MLflow run again."""
    driver.get(links["run"])
    wait_for_text(driver, ours.info.run_name)
    assert ours.data.tags["prefect.flow_run_url"] == f"{prefect_ui}/v2/runs/flow-run/{run_id}"
    to_prefect = f"a[href$='/runs/flow-run/{run_id}']"
    wait_for(driver, lambda d: d.find_elements("css selector", to_prefect), "the Prefect link in the run's description")
    driver.save_screenshot(str(screenshots / "05-mlflow-run-with-prefect-link.png"))
    follow_new_tab(driver, to_prefect)
    wait_for_text(driver, "browser 2/1/3")
    wait_for_text(driver, "Completed")
    driver.save_screenshot(str(screenshots / "06-prefect-flow-run.png"))
    select_tab(driver, "Artifacts")
    card = "//*[@data-testid='flow-run-artifacts-grid']//*[normalize-space()='browser-mlflow-run']"
    wait_for(driver, lambda d: d.find_elements("xpath", card), "the link artifact's card")[0].click()
    back = f"a[href='{links['run']}']"
    wait_for(driver, lambda d: d.find_elements("css selector", back), "the artifact's link to the MLflow run")
    driver.save_screenshot(str(screenshots / "07-prefect-link-artifact.png"))
    wait_for(driver, lambda d: clicked_as_a_user(d, back), "a click on the artifact's link to reach it")
    wait_for(driver, lambda d: ours.info.run_id in d.current_url, "the MLflow run page")
    wait_for_text(driver, ours.info.run_name)
    driver.save_screenshot(str(screenshots / "08-mlflow-run-from-prefect.png"))


def cut_headers(driver, names) -> list[str]:
    """Those of `names` whose runs-table header text is cut (shown with an ellipsis: wider than its cell)."""
    # MLflow's header cell: <div role=columnheader><div (ellipsis)><span data-testid="sort-header-NAME">NAME</span>
    script = """return Array.from(document.querySelectorAll('[role=columnheader] [data-testid^="sort-header-"]'))
        .filter(e => arguments[0].includes(e.textContent.trim()))
        .filter(e => e.parentElement.scrollWidth > e.parentElement.clientWidth
                     || e.getBoundingClientRect().width > e.parentElement.getBoundingClientRect().width + 0.5)
        .map(e => e.textContent.trim());"""
    return driver.execute_script(script, list(names))


def header_texts(driver) -> list[str]:
    """The MLflow runs table's column headers as shown (a header scrolled out of view has no text)."""
    return [h.text.strip() for h in driver.find_elements("css selector", ".ag-header-cell") if h.text.strip()]
