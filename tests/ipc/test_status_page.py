"""The worker's status page: written by the worker, read by Python front ends and Go
gateways alike (the same layout, rule and words)."""

from __future__ import annotations

from pathlib import Path

from scripts import go_contract
from service.ipc.status_page import PAGE_BYTES, QueueFill, StatusPage, StatusView, page_path

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "worker-status.page"


def test_the_page_is_read_as_it_was_written(tmp_path: Path) -> None:
    page = StatusPage(page_path(tmp_path), max_queue_size=8, max_queue_bytes=1000)
    view = StatusView(page_path(tmp_path))
    assert view.fill() == QueueFill(0, 0, 8, 1000)
    page.publish(3, 600)
    assert view.fill() == QueueFill(3, 600, 8, 1000)
    assert view.refusal(401) == (
        "queue full: 600 bytes waiting, this request adds 401 (max_queue_bytes=1000); "
        "retry with backoff"
    )
    assert view.refusal(400) is None  # exactly at the bound: taken
    page.publish(8, 600)
    assert (
        view.refusal(1) == "queue full: 8 requests waiting (max_queue_size=8); retry with backoff"
    )
    page.close()
    restarted = StatusPage(page_path(tmp_path), max_queue_size=8, max_queue_bytes=1000)
    assert view.fill() == QueueFill(0, 0, 8, 1000)  # the same page, written by a new worker
    restarted.close()
    view.close()


def test_an_empty_queue_takes_any_legal_request() -> None:
    assert QueueFill(0, 0, 4, 100).refusal(10_000) is None
    assert QueueFill(1, 10, 4, 100).refusal(91) is not None


def test_a_refusal_shows_no_more_than_the_queue_can_hold() -> None:
    """Unread requests count toward the decision; the worker refuses those past its bounds,
    so the numbers shown stop at what the queue can hold (the gateway's are the same)."""
    room = QueueFill(60, 600, 64, 1000)
    assert room.refusal(1, 9, 40) == (
        "queue full: 64 requests waiting (max_queue_size=64); retry with backoff"
    )
    assert room.refusal(300, 3, 900) == (
        "queue full: 1000 bytes waiting, this request adds 300 (max_queue_bytes=1000); "
        "retry with backoff"
    )
    # One unread request larger than the bound, on its way to an empty queue (which takes it).
    assert QueueFill(0, 0, 64, 600_000).refusal(1 << 20, 1, 1 << 20) == (
        "queue full: 1048576 bytes waiting, this request adds 1048576 "
        "(max_queue_bytes=600000); retry with backoff"
    )
    big = QueueFill(1, 1 << 20, 64, 600_000)  # one request larger than the bound alone
    assert big.refusal(1 << 20, 1, 1 << 20) == (
        "queue full: 1048576 bytes waiting, this request adds 1048576 "
        "(max_queue_bytes=600000); retry with backoff"
    )


def test_no_page_yet_refuses_nothing(tmp_path: Path) -> None:
    assert StatusView(page_path(tmp_path)).refusal(1 << 30) is None


def test_golden_page_bytes(tmp_path: Path) -> None:
    """The page Python writes for a known fill, byte for byte: the Go gateway's tests read
    the same file (service/gateway/status_test.go)."""
    page = StatusPage(page_path(tmp_path), max_queue_size=64, max_queue_bytes=3 << 20)
    page.publish(5, 123_456)
    page.close()
    written = page_path(tmp_path).read_bytes()
    assert len(written) == PAGE_BYTES
    assert written == GOLDEN.read_bytes()


def test_the_go_contract_is_generated_from_the_python_one() -> None:
    assert go_contract.main(["--check"]) == 0, "run python -m scripts.go_contract"
