"""The docs say what the server does: every metric family a running server exposes is in the
observability page's table and every family there is exposed; every PromQL expression in the
docs and in monitoring/ passes promtool; every code block marked `<!-- run -->` runs against a
real server (a comment holding a Python literal after an expression is checked as its value)."""

from __future__ import annotations

import ast
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tokenize
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from service.client import AttentionClient
from tests.harness.server_process import ServerProcess
from tests.observability.test_monitoring import (
    _alert_queries,
    _autoscaling_queries,
    _dashboard_queries,
)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
OBSERVABILITY = DOCS / "observability.md"
PROMTOOL = shutil.which("promtool")
REQUIRED = os.environ.get("ATTENTION_REQUIRE_PROMETHEUS") == "1"

FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
RUN_MARK = re.compile(r"<!-- run -->\n+```(\w+)\n(.*?)^```$", re.M | re.S)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
BY_LABEL = re.compile(r"^\w+\{\w+(, *\w+)*\}$")
METRIC_ROW = re.compile(r"^\| `(attention_\w+)` \|", re.M)
# A family that exists only where its hardware does: documented, but not on a CPU-only host.
HARDWARE_ONLY = re.compile(r"^attention_gpu_")


@pytest.fixture(scope="module")
def rest_server(model_repository: Path, grpc_gateway: str) -> Iterator[ServerProcess]:
    """The default server with its REST port open, in each gateway mode (the pages' gRPC
    examples work with the gateway in front and without it)."""
    with ServerProcess(model_repository, http=True) as process:
        yield process


def _documented_families() -> set[str]:
    text = OBSERVABILITY.read_text()
    section = text[text.index("## Metrics") :]
    section = section[: section.index("\n## ", 1)]
    return set(METRIC_ROW.findall(section))


def _exposed_families(text: str) -> set[str]:
    """Family names from the exposition's TYPE lines (a histogram's _bucket/_sum/_count samples
    and a counter's _total fall under the family the TYPE line names)."""
    return set(re.findall(r"^# TYPE (attention_\w+) ", text, re.M))


def test_every_exposed_metric_is_documented_and_every_documented_one_exposed(
    rest_server: ServerProcess,
) -> None:
    x = np.ones((4, 512), np.float32)
    with AttentionClient(rest_server.target) as client:
        client.attend(x)  # gRPC: the api="attention" series
    body = json.dumps(
        {
            "inputs": [
                {
                    "name": "embeddings",
                    "shape": [1, 4, 512],
                    "datatype": "FP32",
                    "data": x.ravel().tolist(),
                }
            ]
        }
    ).encode()
    request = urllib.request.Request(
        f"http://{rest_server.http_url}/v2/models/mha/infer", body, method="POST"
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 200
    scrape = f"http://127.0.0.1:{rest_server.metrics_port}/metrics"
    with urllib.request.urlopen(scrape, timeout=30) as answer:
        text = answer.read().decode()
    assert 'api="rest"' in text  # the label the observability page lists for REST

    exposed = _exposed_families(text)
    documented = _documented_families()
    assert len(exposed) > 15, text
    undocumented = sorted(exposed - documented)
    assert not undocumented, f"exposed but not in docs/observability.md: {undocumented}"
    missing = sorted(f for f in documented - exposed if not HARDWARE_ONLY.match(f))
    assert not missing, f"in docs/observability.md but not exposed: {missing}"


def _code_spans(text: str) -> Iterator[tuple[int, str]]:
    """(line number, inline code) outside fenced blocks."""
    in_fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        if not in_fence and not line.startswith("    "):
            for span in INLINE_CODE.findall(line):
                yield number, span


def _looks_like_promql(span: str) -> bool:
    """A span naming a series, with PromQL's shape; `name{label}` (a family by its label, as
    prose writes it) is notation, not an expression."""
    if BY_LABEL.match(span):
        return False
    names_a_series = re.search(r"\b(attention_[a-z_]+|nv_[a-z_]+|up)\b", span)
    return bool(names_a_series) and bool(re.search(r"[({\[]|==|[<>]", span))


def _doc_promql() -> list[tuple[str, str]]:
    """(where, expression): inline code that names a series and has PromQL's shape, and every
    fenced block marked promql (expressions separated by blank lines)."""
    found = []
    for page in PAGES:
        text = page.read_text()
        where = str(page.relative_to(ROOT))
        found += [
            (f"{where}:{n}", span) for n, span in _code_spans(text) if _looks_like_promql(span)
        ]
        for language, block in FENCE.findall(text):
            if language == "promql":
                found += [(where, expr.strip()) for expr in block.split("\n\n") if expr.strip()]
    return found


def _promql_everywhere() -> list[tuple[str, str]]:
    return [
        *_doc_promql(),
        *[("monitoring/grafana/dashboards/attention.json", q) for q in _dashboard_queries()],
        *[("monitoring/alerts.yml", q) for q in _alert_queries()],
        *[("k8s/autoscaling/prometheus-adapter.yaml", q) for q in _autoscaling_queries()],
    ]


def test_the_promql_finder_finds_the_pages_expressions() -> None:
    found = [expr for _, expr in _doc_promql()]
    assert "sum by (code) (rate(attention_requests_total[1m]))" in found
    assert 'up{job="attention"} == 0' in found
    assert not _looks_like_promql("attention_weights")
    assert not _looks_like_promql("--restricted-api GROUPS:KEY=VALUE")
    assert not _looks_like_promql("attention_restricted_api_denials_total{group}")
    assert _looks_like_promql('attention_batches_total{graph="output"}')


def test_every_promql_expression_passes_promtool(tmp_path: Path) -> None:
    if PROMTOOL is None:
        if REQUIRED:
            pytest.fail("promtool is not installed (apt-get install prometheus)")
        pytest.skip("promtool not installed; .ci/run installs Debian's prometheus package")
    expressions = _promql_everywhere()
    assert len(expressions) > 20
    # Each expression as a recording rule in a group named after where it was found: promtool
    # parses and type-checks it (what a Prometheus would refuse) and names the group it fails.
    groups = [
        {"name": f"{where} #{i}", "rules": [{"record": f"docs_expression_{i}", "expr": expr}]}
        for i, (where, expr) in enumerate(expressions)
    ]
    rules = tmp_path / "expressions.yml"
    rules.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    done = subprocess.run(
        [PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"{done.stdout}{done.stderr}"


def test_promtool_refuses_what_the_pages_once_showed(tmp_path: Path) -> None:
    """The check has teeth: the dashboard table's old p50/p99 shorthand is refused."""
    if PROMTOOL is None:
        pytest.skip("promtool not installed")
    bad = "histogram_quantile(0.5 and 0.99, sum by (le) (rate(x_bucket[1m])))"
    rules = tmp_path / "bad.yml"
    rules.write_text(
        yaml.safe_dump({"groups": [{"name": "g", "rules": [{"record": "bad", "expr": bad}]}]})
    )
    done = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True)
    assert done.returncode != 0


def _runnable_blocks() -> list[tuple[str, str, str]]:
    """(where, language, code) of every block marked `<!-- run -->`."""
    return [
        (
            f"{page.relative_to(ROOT)}:{page.read_text()[: match.start()].count(chr(10)) + 2}",
            match[1],
            match[2],
        )
        for page in PAGES
        for match in RUN_MARK.finditer(page.read_text())
    ]


def _with_checked_comments(code: str) -> str:
    """Each expression statement followed by a comment that is a Python literal becomes an
    assertion that the expression equals it: `result.output.shape  # (16, 512)`."""
    comments = {
        token.start[0]: token.string[1:].strip()
        for token in tokenize.generate_tokens(io.StringIO(code).readline)
        if token.type == tokenize.COMMENT
    }
    lines = code.splitlines()
    for statement in ast.walk(ast.parse(code)):
        if not isinstance(statement, ast.Expr) or statement.lineno != statement.end_lineno:
            continue
        comment = comments.get(statement.lineno)
        try:
            expected = ast.literal_eval(comment) if comment else None
        except (ValueError, SyntaxError):
            continue
        if expected is None:
            continue
        line = lines[statement.lineno - 1]
        indent = line[: len(line) - len(line.lstrip())]
        expression = ast.get_source_segment(code, statement)
        lines[statement.lineno - 1] = (
            f"{indent}assert ({expression}) == {comment}, ({expression!r}, {expression})"
        )
    return "\n".join(lines) + "\n"


def _on_this_server(code: str, server: ServerProcess) -> str:
    for host in ("127.0.0.1", "localhost"):
        code = code.replace(f"{host}:8001", server.target)
        code = code.replace(f"{host}:8000", server.http_url)
        code = code.replace(f"{host}:8002", f"127.0.0.1:{server.metrics_port}")
    return code


def test_the_comment_checker_turns_literals_into_assertions() -> None:
    checked = _with_checked_comments("x = (1, 2)  # [a, b]\nx  # (1, 2)\nprint(x)  # shows it\n")
    assert "assert (x) == (1, 2)" in checked
    assert checked.startswith("x = (1, 2)")
    with pytest.raises(AssertionError):
        exec(_with_checked_comments("len([1])  # 2\n"), {})


def test_pages_mark_their_examples_runnable() -> None:
    marked = {where.split(":")[0] for where, _, _ in _runnable_blocks()}
    assert {"README.md", "docs/api.md", "docs/getting-started.md"} <= marked


@pytest.mark.parametrize(
    ("where", "language", "code"), _runnable_blocks(), ids=[b[0] for b in _runnable_blocks()]
)
def test_every_runnable_block_runs_against_a_real_server(
    rest_server: ServerProcess, tmp_path: Path, where: str, language: str, code: str
) -> None:
    code = _on_this_server(code, rest_server)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if language == "python":
        command = [sys.executable, "-c", _with_checked_comments(code)]
    elif language in ("sh", "bash"):
        # curl fails on an HTTP error status, so an example that gets a 4xx does not pass;
        # python is the one in the environment the tests run in (the docs say .venv/bin/python).
        prelude = (
            "set -euo pipefail\n"
            'curl() { command curl --silent --show-error --fail-with-body "$@"; }\n'
            f"PATH={Path(sys.executable).parent}:$PATH\n"
        )
        command = ["bash", "-c", prelude + code.replace(".venv/bin/", "")]
    else:
        pytest.fail(f"{where}: no way to run a {language!r} block")
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{where}:\n{code}\n{done.stdout}{done.stderr}"


def test_no_user_facing_text_names_a_development_issue() -> None:
    """Users know nothing of the project's issue tracker: pages and the Makefile say what a
    target is instead of which issue asked for it."""
    issue = re.compile(r"\bissues? #?\d+", re.I)
    for path in [*PAGES, ROOT / "Makefile"]:
        found = issue.findall(path.read_text())
        assert not found, f"{path.relative_to(ROOT)} names {found}"
