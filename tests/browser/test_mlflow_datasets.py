"""The runs table grouped and filtered by the training data, in a fresh headless Chromium on the real `mlflow
server`: three parent runs as the pipeline logs them (the data stage's output as an MLflow dataset input,
`RunLogger.log_dataset`), two trained on the same prompts and one on served traffic. From the experiment link
eagleops prints, "Group by" -> Dataset shows one group per dataset (name and digest) holding its runs, and the
Datasets filter keeps only the runs of the dataset ticked. Screenshots under the test's tmp dir (and
$EAGLEOPS_TEST_ARTIFACTS)."""

from __future__ import annotations

import json
import uuid

import pytest

from tasks.tracking.run_logger import create_run
from tasks.tracking.views import run_links
from tests.browser.test_ui import body_text, browser, screenshots, wait_for, wait_for_text  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow

PROMPTS = ("prompts:chat.jsonl", "a1b2c3d4e5f60718")
SERVED = ("served:dumps", "0f1e2d3c4b5a6978")


def dataset(name: str, digest: str) -> dict[str, str]:
    return {"name": name, "digest": digest, "source_type": "local", "source": json.dumps({"uri": "file:///data"}),
            "profile": json.dumps({"num_samples": 12, "digest": digest})}


@pytest.fixture
def runs(mlflow_server):
    """{run name: run} in an experiment of their own: draft-a and draft-b on PROMPTS, draft-c on SERVED."""
    mlflow_server.start()
    experiment = f"eagleops-datasets-{uuid.uuid4().hex[:6]}"
    made = {}
    for name, data in (("draft-a", PROMPTS), ("draft-b", PROMPTS), ("draft-c", SERVED)):
        run = create_run(mlflow_server.uri, None, name, {"eagleops.kind": "experiment"}, experiment=experiment)
        run.log_dataset(dataset(*data), context="training")
        run.log_metrics({"run_benchmark.best_tok_s": 100.0})
        run.finish("FINISHED")
        made[name] = run
    return made


def option(driver, text: str):
    xpath = f"//*[@role='option' or @role='menuitemcheckbox' or @role='menuitem'][normalize-space()='{text}']"
    return wait_for(driver, lambda d: d.find_elements("xpath", xpath), f"the menu option '{text}'")[0]


def group_rows(driver) -> dict[str, int]:
    """The grouped table's group rows, 'Group: <dataset name>.<digest>' -> the run count shown beside it."""
    # A group row's pinned cells read "Pin group / <colour> / Group: <name>.<digest> / <count> / -", one a line.
    script = "return Array.from(document.querySelectorAll('.ag-row')).map(r => r.innerText);"
    rows = {}
    for text in driver.execute_script(script):
        lines = text.split("\n")
        labels = [i for i, line in enumerate(lines) if line.startswith("Group: ")]
        if labels and labels[0] + 1 < len(lines) and lines[labels[0] + 1].isdigit():
            rows[lines[labels[0]]] = int(lines[labels[0] + 1])
    return rows


def shown_runs(driver) -> list[str]:
    names = ("draft-a", "draft-b", "draft-c")
    return sorted(name for name in names if driver.find_elements("xpath", f"//a[normalize-space()='{name}']"))


def test_the_runs_table_groups_and_filters_by_training_dataset(mlflow_server, runs, browser, screenshots):
    links = run_links(mlflow_server.uri, runs["draft-a"].run_id)
    browser.get(links["experiment"])
    wait_for(browser, lambda d: shown_runs(d) == ["draft-a", "draft-b", "draft-c"], "the three runs")

    # the eagleops view shows the Dataset column: each run's data by name and digest (and its context)
    wait_for(browser, lambda d: "Dataset" in [h.text.strip() for h in d.find_elements("css selector", ".ag-header-cell")],
             "the Dataset column")
    wait_for_text(browser, f"{SERVED[0]} ({SERVED[1]})")
    browser.save_screenshot(str(screenshots / "mlflow-dataset-column.png"))

    # Group by -> Attributes: Dataset
    wait_for(browser, lambda d: d.find_elements("xpath", "//button[normalize-space()='Group by']"), "Group by")
    browser.find_element("xpath", "//button[normalize-space()='Group by']").click()
    option(browser, "Dataset").click()
    expected = {f"Group: {PROMPTS[0]}.{PROMPTS[1]}": 2, f"Group: {SERVED[0]}.{SERVED[1]}": 1}
    wait_for(browser, lambda d: group_rows(d) == expected, f"the groups {expected}")
    browser.save_screenshot(str(screenshots / "mlflow-grouped-by-dataset.png"))
    assert shown_runs(browser) == ["draft-a", "draft-b", "draft-c"]

    # Datasets filter: tick the served one, only its run is left
    browser.get(links["experiment"])
    wait_for(browser, lambda d: shown_runs(d) == ["draft-a", "draft-b", "draft-c"], "the three runs again")
    browser.find_element("css selector", "[data-testid='datasets-select-dropdown']").click()
    wait_for_text(browser, f"{SERVED[0]} ({SERVED[1]})")
    browser.find_element("css selector", f"[data-testid='dataset-dropdown-{SERVED[0]}']").click()
    wait_for(browser, lambda d: shown_runs(d) == ["draft-c"], "only the served-data run")
    wait_for_text(browser, "1 matching run")
    browser.save_screenshot(str(screenshots / "mlflow-filtered-by-dataset.png"))
    assert "datasetsFilter=" in browser.current_url  # the filter travels with the link
