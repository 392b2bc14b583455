"""Alerting rules and dashboards against the real thing, with Debian's promtool: the rules'
unit tests (firing and not firing), the PrometheusRule equal to monitoring/alerts.yml, and
every dashboard query, alert expression and autoscaling query run by a real Prometheus
that scrapes a real server, each finding the series it names."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from bench.harness import metrics_text, wait_for
from service.client import AttentionClient
from tests.harness.prometheus import PROMTOOL, need, scraping
from tests.harness.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "monitoring"
# Series that exist only where their hardware does (a GPU): checked by bench/gpu.sh there.
HARDWARE_ONLY = re.compile(r"\battention_gpu_")
# Grafana's own variables, as Grafana would expand them for a 1-minute range.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


def _promtool(*args: str, cwd: Path = ROOT, stdin: str | None = None) -> str:
    done = subprocess.run(
        [need(PROMTOOL, "promtool"), *args],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout


def _alert_groups() -> list[dict]:
    return yaml.safe_load((MONITORING / "alerts.yml").read_text())["groups"]


def test_alerting_rules_are_valid_and_their_unit_tests_pass() -> None:
    assert "SUCCESS: 8 rules found" in _promtool("check", "rules", "alerts.yml", cwd=MONITORING)
    assert "SUCCESS" in _promtool("test", "rules", "alerts_test.yml", cwd=MONITORING)


def test_every_alert_has_a_firing_case_in_the_unit_tests() -> None:
    tests = yaml.safe_load((MONITORING / "alerts_test.yml").read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    alerts = {rule["alert"] for group in _alert_groups() for rule in group["rules"]}
    firing = {case["alertname"] for case in cases if case["exp_alerts"]}
    silent = {case["alertname"] for case in cases if not case["exp_alerts"]}
    assert firing == alerts, alerts - firing
    assert silent == alerts, alerts - silent


def test_prometheus_rule_in_kubernetes_matches_alerts_yml() -> None:
    (rule,) = yaml.safe_load_all((ROOT / "k8s/base/prometheusrule.yaml").read_text())
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == _alert_groups()
    base = yaml.safe_load((ROOT / "k8s/base/kustomization.yaml").read_text())
    assert "prometheusrule.yaml" in base["resources"]


def _dashboard_queries() -> list[str]:
    dashboard = json.loads((MONITORING / "grafana/dashboards/attention.json").read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    for variable, value in GRAFANA_VARIABLES.items():
        queries = [query.replace(variable, value) for query in queries]
    assert queries
    assert not [query for query in queries if "$" in query], "unexpanded dashboard variable"
    return queries


def _alert_queries() -> list[str]:
    return [rule["expr"] for group in _alert_groups() for rule in group["rules"]]


def _autoscaling_queries() -> list[str]:
    """prometheus-adapter's rules with its template filled as the adapter would for a pod."""
    (config,) = yaml.safe_load_all((ROOT / "k8s/autoscaling/prometheus-adapter.yaml").read_text())
    queries = []
    for rule in yaml.safe_load(config["data"]["config.yaml"])["rules"]:
        series = rule["seriesQuery"].split("{")[0].strip("'")
        fill = {
            "<<.Series>>": series,
            "<<.LabelMatchers>>": 'job="attention"',
            "<<.GroupBy>>": "instance",
        }
        query = rule["metricsQuery"]
        for template, value in fill.items():
            query = query.replace(template, value)
        queries.append(query)
    assert queries
    return queries


@pytest.fixture(scope="module")
def prometheus(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus scraping the session's server every second."""
    with scraping(server.metrics_port, tmp_path_factory.mktemp("prometheus-monitoring")) as base:
        yield base


def _instant(base: str, promql: str) -> list[dict]:
    return json.loads(_promtool("query", "instant", "-o", "json", base, promql))


def _names(promql: str) -> set[str]:
    return set(re.findall(r"\b(attention_[a-z_]+|up)\b", promql))


@pytest.mark.gateway_off_heavy
def test_every_query_runs_on_real_metrics_and_finds_its_series(
    prometheus: str, server: ServerProcess
) -> None:
    with AttentionClient(server.target) as client:
        for seq in (4, 8, 16):
            client.attend(np.ones((seq, 32), np.float32), model="causal")
    text = metrics_text(f"http://127.0.0.1:{server.metrics_port}/metrics")
    # The exposition itself passes promtool's lint (names, units, help).
    _promtool("check", "metrics", stdin=text)
    # Sampled series, and families declared with no sample yet (no drop has happened).
    exposed = set(re.findall(r"^(\w+)|^# TYPE (\w+)", text, re.M))
    exposed = {name for pair in exposed for name in pair if name}

    # Two scrapes after the traffic, so rate() over 1m has points to work with.
    traffic = 'sum(increase(attention_requests_total{model="causal"}[1m]))'
    wait_for(lambda: _instant(prometheus, traffic), what=traffic, timeout_s=60, poll_s=0.2)
    # Dashboards and autoscaling must find data; alerts must run (they are empty when quiet).
    expect_data = _dashboard_queries() + _autoscaling_queries()
    for query in expect_data + _alert_queries():
        result = _instant(prometheus, query)  # promtool fails on a query that does not parse
        if HARDWARE_ONLY.search(query) and not _names(query) & exposed:
            continue  # no GPU here: the panel stays empty
        for name in _names(query) - {"up"}:
            series = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in exposed or series in exposed or f"{name}_total" in exposed, (
                f"{query!r} names {name}, which the server does not expose"
            )
        if query in expect_data and "attention_requests_dropped_total" not in query:
            assert result, f"{query!r} found nothing on a server that has served traffic"
