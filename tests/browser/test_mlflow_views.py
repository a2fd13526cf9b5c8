"""What a new user sees in MLflow from the links eagleops prints: in a fresh Chromium profile (MLflow 3.17's UI would
open on its GenAI overview), the experiment link lands on the training runs table with the headline metrics as
columns, the charts link on tok/s and speedup first, and the run link on the run. (tests/browser/test_ui.py checks
the same table right after a real run.) Screenshots are kept under the test's tmp dir (and $EAGLEOPS_TEST_ARTIFACTS)."""

from __future__ import annotations

import pytest

from tasks.tracking.run_logger import create_run
from tasks.tracking.views import HEADLINE_METRICS, run_links
from tests.browser.test_ui import (  # noqa: F401  (fixtures)
    browser,
    cut_headers,
    header_texts,
    screenshots,
    wait_for,
    wait_for_text,
)

pytestmark = pytest.mark.slow

HEADLINE = {"run_benchmark.best_tok_s": 1266.8, "run_benchmark.speedup": 1.61,
            "run_benchmark.accept_length_online": 3.32, "run_benchmark.accept_length_offline": 3.59,
            "run_benchmark.baseline_tok_s": 784.9,
            # alphabetically first: MLflow's default columns and charts would start here
            "check_environment.env_warnings": 0.0, "check_environment.wall_time_s": 0.1}


@pytest.fixture
def parent_run(mlflow_server):
    """An eagleops parent run created as the pipeline creates it (the experiment and its view included)."""
    run = create_run(mlflow_server.uri, None, "browser-views-20261201-143744-aca224",
                     {"eagleops.kind": "experiment", "eagleops.best_setting": "4/1/5"}, experiment="eagleops-views")
    run.log_metrics(HEADLINE)
    run.finish("FINISHED")
    return run


def header_ids(driver) -> list[str]:
    return [h.get_attribute("col-id") for h in driver.find_elements("css selector", ".ag-header-cell")]


def test_the_printed_experiment_link_opens_the_runs_table_with_the_headline_columns(mlflow_server, parent_run, browser,
                                                                                    screenshots):
    links = run_links(mlflow_server.uri, parent_run.run_id)
    browser.get(links["experiment"])
    wait_for_text(browser, "browser-views-20261201")
    # tok/s, speedup and both accept lengths right after the run's name and start (at 1920 px MLflow's Assistant
    # panel can hide the fourth's right edge; what is checked is that each header reads whole)
    wait_for(browser, lambda d: set(HEADLINE_METRICS[:4]) <= set(header_texts(d)), "the headline metric columns")
    browser.save_screenshot(str(screenshots / "mlflow-experiment-link.png"))
    assert "/runs" in browser.current_url and "overview" not in browser.current_url
    headers = header_texts(browser)
    assert not cut_headers(browser, HEADLINE_METRICS[:4])  # their names read whole (MLflow's 100 px cut them)
    assert {"Run Name", "Created", *HEADLINE_METRICS[:4]} <= set(headers), headers  # (DOM order is not screen order)
    assert "metrics.`check_environment.env_warnings`" not in header_ids(browser)  # the headline, not every metric
    body = browser.find_element("tag name", "body").text
    for value in ("1266.8", "1.61", "3.32", "3.59"):
        assert value in body, body
    # model-training mode, not the GenAI overview a fresh browser gets without the link's workflowType
    assert "Evaluation runs" not in body and "Traces" not in headers
    assert browser.find_element("xpath", "//*[normalize-space()='Model training']")

    browser.get(links["run"])
    wait_for_text(browser, "browser-views-20261201-143744-aca224")
    wait_for_text(browser, "run_benchmark.best_tok_s")
    browser.save_screenshot(str(screenshots / "mlflow-run-link.png"))


def chart_titles(driver) -> list[str]:
    """The chart view's card titles in screen order (MLflow keeps the full metric key in the title attribute)."""
    cards = driver.find_elements("css selector", "[data-testid='experiment-view-compare-runs-card']")
    return [title.get_attribute("title") for card in cards for title in card.find_elements("css selector", "h4[title]")]


def test_the_printed_charts_link_compares_runs_by_tok_s_and_speedup_first(mlflow_server, parent_run, browser, screenshots):
    links = run_links(mlflow_server.uri, parent_run.run_id)
    browser.get(links["charts"])
    wait_for(browser, lambda d: len(chart_titles(d)) >= 2, "the headline charts")
    browser.save_screenshot(str(screenshots / "mlflow-charts-link.png"))
    titles = chart_titles(browser)
    assert titles[:2] == ["run_benchmark.best_tok_s", "run_benchmark.speedup"], titles
    assert "check_environment.env_warnings" not in titles, titles  # alphabetically first, MLflow's own default
