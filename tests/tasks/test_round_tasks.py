"""The layout of the train-clients task runs (tasks/round.py)."""

import pytest

from tasks.round import chunked, train_task_chunks


def test_in_process_clients_train_in_one_task_run_chunk_by_chunk():
    assert train_task_chunks(list(range(10)), 4, in_process=True) == [
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]]


def test_remote_clients_get_one_task_run_per_chunk():
    assert train_task_chunks([3, 1, 4, 1, 5], 2, in_process=False) == [
        [[3, 1]], [[4, 1]], [[5]]]
    assert train_task_chunks([3, 1, 4, 1, 5], 2, in_process=False) == [
        [c] for c in chunked([3, 1, 4, 1, 5], 2)]


def test_no_clients_no_task_run_and_a_bad_chunk_size_is_refused():
    assert train_task_chunks([], 8, in_process=True) == []
    assert train_task_chunks([], 8, in_process=False) == []
    with pytest.raises(ValueError, match="chunk_size"):
        train_task_chunks([1, 2], 0, in_process=True)


def test_round_runs_start_no_heartbeat_thread_of_their_own(monkeypatch):
    """A round's nested flow run is entered without Prefect's heartbeat (its thread is
    joined at the end of every run: 0.5 s on average); the federation run's setting is
    untouched before and after."""
    import prefect.flow_engine as fe
    from prefect.settings import get_current_settings

    from flows.federation import round_run_settings

    before = get_current_settings().flows.heartbeat_frequency
    assert before is not None and before >= 30
    with round_run_settings():
        assert get_current_settings().flows.heartbeat_frequency is None
        started = []
        monkeypatch.setattr(fe.threading, "Thread",
                            lambda *a, **k: started.append(k) or pytest.fail("thread"))

        class _Engine:  # what _send_heartbeats reads from the flow run engine
            heartbeat_seconds = property(fe.FlowRunEngine.heartbeat_seconds.fget)

        with fe._send_heartbeats(_Engine()):
            pass
        assert started == []
    assert get_current_settings().flows.heartbeat_frequency == before
