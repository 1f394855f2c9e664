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
