"""The draft worker on /metrics and in the log: failures counted per cause and warned once per cause per window with
the exception's message; the client's generation, the worker's own drafted-node count and the arena bytes as
gauges."""

import logging

from prometheus_client import CollectorRegistry

from sgl_dspark.observe import Series, StepStats, WorkerMetrics

STEP = StepStats([1], [2], [1], 0.001, 0.001, 0.001)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_failures_are_counted_per_cause_and_warned_once_per_cause_per_window(caplog):
    wm = WorkerMetrics(log_interval=1)
    with caplog.at_level(logging.WARNING, logger="sgl_dspark"):
        wm.draft_worker_failed("dead", "draft worker 12 died (exit code -9)")
        wm.draft_worker_failed("restarting", "draft worker is restarting")
        wm.draft_worker_failed("restarting", "draft worker is restarting")
        wm.observe(STEP)  # a new window: each cause is worth one warning again
        wm.draft_worker_failed("restarting")
    assert wm.draft_failures == 4 and wm.failures_by_cause == {"dead": 1, "restarting": 3}
    said = warnings(caplog)
    assert len(said) == 3
    assert "(dead: draft worker 12 died (exit code -9))" in said[0] and "1 failures so far" in said[0]
    assert "(restarting: draft worker is restarting)" in said[1] and said[2].startswith(
        "draft worker unavailable (restarting):")


def test_series_count_failures_by_cause_and_show_the_worker_state():
    registry = CollectorRegistry()
    wm = WorkerMetrics(series=Series({"model_name": "m"}, registry=registry))
    wm.draft_worker_failed("shm_full", "draft arenas: /dev/shm (size 64 MiB, 0 MiB free): ...")
    wm.draft_worker_failed("shm_full")
    wm.draft_worker_failed()
    wm.draft_worker_state(2, 37, 4096)
    value = lambda name, **extra: registry.get_sample_value(name, {"model_name": "m", **extra})  # noqa: E731
    assert value("sglang:dspark_draft_worker_failures_total", cause="shm_full") == 2
    assert value("sglang:dspark_draft_worker_failures_total", cause="unknown") == 1
    assert value("sglang:dspark_draft_worker_generation") == 2
    assert value("sglang:dspark_draft_worker_drafted_nodes") == 37
    assert value("sglang:dspark_draft_arena_bytes") == 4096
    wm.draft_worker_state(3, 0)  # after another restart the new worker's count starts again
    assert value("sglang:dspark_draft_worker_generation") == 3
    assert value("sglang:dspark_draft_worker_drafted_nodes") == 0


def test_worker_state_without_metrics_is_a_no_op():
    WorkerMetrics().draft_worker_state(1, 5, 10)
