"""A real `pointforge serve` process under load and faults, loopback only, on the tiny models.

Twenty uploads sent at once are all accepted and all finish; a corrupt upload
is refused with its one-line reason and the next one runs; a server killed
with SIGKILL in the middle of a job and started again finishes the queue, and
every case is written exactly once.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serve.live import LiveServer

pytestmark = pytest.mark.timeout(600)  # the tiny models are trained first, in the session fixture


def case_folders(data_dir):
    return sorted(p.name for p in (data_dir / "cases").iterdir() if p.is_dir())


def test_twenty_concurrent_uploads_all_finish_and_a_corrupt_one_says_why(tiny_models, tmp_path):
    pcdiff, voxelizer, skull = tiny_models
    body = skull.read_bytes()
    data = tmp_path / "data"
    server = LiveServer(data, pcdiff, voxelizer, "--workers", "2")
    try:
        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(lambda k: server.upload(body, f"skull{k}.nrrd"), range(20)))
        assert [a.status_code for a in answers] == [201] * 20
        corrupt = server.upload(body[: len(body) // 2], "broken.nrrd")
        assert corrupt.status_code == 400 and "\n" not in corrupt.json()["detail"], corrupt.text
        after = server.upload(body, "after-the-corrupt-one.nrrd")
        assert after.status_code == 201
        jobs = server.wait_until_finished(21)
        assert [j["status"] for j in jobs] == ["done"] * 21, [j["message"] for j in jobs]
        ids = {a.json()["id"] for a in answers} | {after.json()["id"]}
        assert set(case_folders(data)) == ids
        report = server.client.get(f"/api/cases/{after.json()['id']}").json()["report"]
        assert report["mesh"]["watertight"] and report["implant"]["voxels"] > 0
        stl = server.client.get(f"/api/cases/{after.json()['id']}/printable.stl")  # the vote, as generated
        assert stl.status_code == 200 and len(stl.content) > 84
    finally:
        server.kill()


def test_a_server_killed_mid_job_finishes_the_queue_after_a_restart_without_duplicates(tiny_models, tmp_path):
    pcdiff, voxelizer, skull = tiny_models
    body = skull.read_bytes()
    data = tmp_path / "data"
    server = LiveServer(data, pcdiff, voxelizer, name="first")
    ids = [server.upload(body, f"skull{k}.nrrd").json()["id"] for k in range(3)]
    deadline = time.monotonic() + 60
    while not any(j["status"] == "running" and j["stage"] not in ("", "starting") for j in server.jobs()):
        assert time.monotonic() < deadline, server.jobs()
        time.sleep(0.05)
    server.kill()  # SIGKILL: no clean-up of any kind
    restarted = LiveServer(data, pcdiff, voxelizer, name="second")
    try:
        assert "recovered after a stop: 1 job(s) queued again" in restarted.job.output()
        jobs = restarted.wait_until_finished(3)
        assert sorted(j["id"] for j in jobs) == sorted(ids) and {j["status"] for j in jobs} == {"done"}
        assert sorted(j["attempts"] for j in jobs)[-1] == 2, "no job was interrupted by the kill"
        assert case_folders(data) == sorted(ids)
        hidden = [p.name for p in (data / "cases").iterdir() if p.name.startswith(".")]
        assert hidden == [], f"partial outputs left behind: {hidden}"
    finally:
        restarted.kill()
