"""The job store: one claim per job, crash recovery, the disk bound that never touches running cases."""

from __future__ import annotations

import threading

from pointforge.serve.store import MAX_ATTEMPTS, JobStore, is_job_id, new_job_id
from pointforge.serve.worker import DataLayout, keep_within


def test_ids_are_server_made_hex_and_nothing_else_passes():
    assert is_job_id(new_job_id())
    for bad in ("../etc", "/etc/passwd", "0123456789abcdeg", "0123456789ABCDEF", "", "a" * 17):
        assert not is_job_id(bad)


def test_each_job_is_claimed_once_even_by_racing_workers(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    ids = [store.add(new_job_id(), f"case{k}", "x.nrrd", "nrrd").id for k in range(30)]
    claimed: list[str] = []

    def worker():
        while (job := store.claim()) is not None:
            claimed.append(job.id)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed) == sorted(ids)
    assert all(job.status == "running" and job.attempts == 1 for job in store.all())


def test_a_job_left_running_is_queued_again_then_failed_with_its_reason(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    store = JobStore(path)
    job = store.add(new_job_id(), "skull.nrrd", "x.nrrd", "nrrd")
    for attempt in range(1, MAX_ATTEMPTS + 1):
        assert store.claim().id == job.id
        store.close()  # the server dies; a new one opens the same file
        store = JobStore(path)
        requeued, failed = store.recover()
        if attempt < MAX_ATTEMPTS:
            assert (requeued, failed) == (1, 0) and store.get(job.id).status == "queued"
    assert (requeued, failed) == (0, 1)
    assert store.get(job.id).status == "failed" and "stopped" in store.get(job.id).message


def test_the_disk_bound_evicts_the_oldest_finished_cases_and_never_a_running_one(tmp_path):
    layout = DataLayout(tmp_path)
    store = JobStore(layout.db)
    jobs = [store.add(new_job_id(), f"c{k}", f"c{k}.nrrd", "nrrd") for k in range(4)]
    for job in jobs:
        store.claim()
        (layout.case(job.id)).mkdir()
        (layout.case(job.id) / "implant.nrrd").write_bytes(b"x" * 100)
    for job in jobs[:3]:
        store.finish(job.id, 1.0, 100)
    assert keep_within(store, layout, 150) == [jobs[0].id, jobs[1].id]
    assert [store.get(j.id).status for j in jobs] == ["evicted", "evicted", "done", "running"]
    assert not layout.case(jobs[0].id).exists() and layout.case(jobs[2].id).exists()
    assert keep_within(store, layout, 0) == [jobs[2].id]
    assert store.get(jobs[3].id).status == "running" and layout.case(jobs[3].id).exists()


def test_a_clean_stop_requeues_running_jobs_without_counting_the_attempt(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    job = store.add(new_job_id(), "skull.nrrd", "x.nrrd", "nrrd")
    store.claim()
    assert store.release_running() == 1
    again = store.get(job.id)
    assert again.status == "queued" and again.attempts == 0 and "stopped" in again.message
    assert store.claim().id == job.id
