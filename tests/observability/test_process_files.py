"""/metrics reads every process's files as the scrape finds them: a child starting or dying
during a scrape does not fail it."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.mmap_dict import MmapedDict, mmap_key

from service.observability.process_files import ProcessFiles


def _counter_file(folder: Path, pid: int, value: float) -> None:
    values = MmapedDict(str(folder / f"counter_{pid}.db"))
    key = mmap_key("attention_requests", "attention_requests_total", ["code"], ["OK"], "Calls.")
    values.write_value(key, value, 0.0)
    values.close()


def _total(collector: ProcessFiles) -> float:
    (family,) = [family for family in collector.collect() if family.name == "attention_requests"]
    return sum(sample.value for sample in family.samples if sample.name.endswith("_total"))


def test_a_file_a_starting_process_has_not_sized_yet_is_left_out(tmp_path: Path) -> None:
    """Before: prometheus-client's collector failed the scrape (struct.error: a 500)."""
    _counter_file(tmp_path, 101, 3.0)
    _counter_file(tmp_path, 102, 4.0)
    (tmp_path / "counter_103.db").write_bytes(b"")  # made, not yet sized
    assert _total(ProcessFiles(str(tmp_path))) == 7.0
