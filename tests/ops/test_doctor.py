"""pointforge doctor: each check's ok / warning / failure, with a fix; exit status on failures."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import torch

from pointforge.ops import doctor, doctor_host, doctor_report, doctor_run
from pointforge.ops.host import FAKE_GPUS_ENV, GpuInventory
from pointforge.tasks.toy import PointMLP
from pointforge.train.checkpoint import format as ck
from tests.helpers import TOY_TINY, run_cli, write_raw_dataset

TINY = TOY_TINY
GB = 2**30


def by_name(report: doctor_report.DoctorReport, name: str) -> list[doctor_report.Check]:
    found = [c for c in report.checks if c.name == name]
    assert found, f"no check named {name!r} in {[c.name for c in report.checks]}"
    return found


def run(tmp_path, **kwargs) -> doctor_report.DoctorReport:
    kwargs.setdefault("config", TINY)
    kwargs.setdefault("overrides", [f"run.dir={tmp_path / 'run'}"])
    kwargs.setdefault("shm_space", (8 * GB, 8 * GB))
    kwargs.setdefault("disk_space", (100 * GB, 50 * GB))
    return doctor.run_doctor(**kwargs)


def test_a_healthy_cpu_setup_passes(tmp_path):
    report = run(tmp_path)
    assert not report.failed, report.text()
    names = {c.name for c in report.checks}
    assert {"python", "torch", "GPUs", "CUDA_VISIBLE_DEVICES", "config", "disk", "/dev/shm", "run dir"} <= names
    assert by_name(report, "config")[0].detail.endswith("loads for task toy")
    assert "0 failure(s)" in report.text()


def test_missing_dataset_is_a_failure_with_a_fix(tmp_path):
    report = run(tmp_path, data=str(tmp_path / "no-data"))
    check = by_name(report, "dataset")[0]
    assert check.status == "failure" and "does not exist" in check.detail
    assert "pointforge data" in check.fix
    assert report.failed and "fix: give the dataset folder" in report.text()


def _prepared(root: Path, *, corrupt: bool = False) -> Path:
    (root / "surfaces").mkdir(parents=True)
    rows = ["case_id,skull_id,defect,split,defective,implant,complete,complete_mask"]
    for i, split in enumerate(["train", "train", "val"]):
        for kind in ("defective", "implant"):
            np.save(root / "surfaces" / f"{kind}{i}.npy", np.random.default_rng(i).random((50, 3), dtype=np.float32))
        rows.append(f"{i:03d},{i:03d},,{split},surfaces/defective{i}.npy,surfaces/implant{i}.npy,,")
    (root / "cases.csv").write_text("\n".join(rows) + "\n")
    (root / "dataset.json").write_text(json.dumps({"layout": "skullfix"}))
    if corrupt:
        (root / "surfaces" / "implant2.npy").write_bytes(b"\x93NUMPY garbage")
    return root


def test_dataset_layouts_and_unreadable_files(tmp_path):
    ok = doctor_run.check_dataset(_prepared(tmp_path / "prep"))
    assert ok.status == "ok" and "3 cases (train 2, val 1, test 0)" in ok.detail
    bad = doctor_run.check_dataset(_prepared(tmp_path / "bad", corrupt=True))
    assert bad.status == "failure" and "implant2.npy" in bad.detail
    raw = doctor_run.check_dataset(write_raw_dataset(tmp_path / "raw", "skullfix", n_skulls=1, shape=(24, 24, 24)))
    assert raw.status == "warning" and "raw skullfix dataset, 1 cases" in raw.detail and "data prepare" in raw.fix
    assert doctor_run.check_dataset(tmp_path / "prep" / "cases.csv").status == "failure"


def test_too_small_dev_shm_for_the_workers_is_a_failure(tmp_path):
    # A container's default 64 MB /dev/shm, four workers per process, two processes.
    small = (64 * 2**20, 64 * 2**20)
    report = run(
        tmp_path, overrides=[f"run.dir={tmp_path / 'run'}", "data.num_workers=4"], nproc=2, shm_space=small, config=TINY
    )
    shm = by_name(report, "/dev/shm")[0]
    assert shm.status == "ok"  # toy batches are tiny: measured from a real sample
    assert "2 process(es) × 4 worker(s)" in shm.detail
    check = doctor_run.check_shm(4, 2, 2, 32 * 2**20, shm=small)
    assert check.status == "failure" and "lower data.num_workers" in check.fix and "--shm-size" in check.fix
    assert doctor_run.check_shm(4, 2, 2, None, shm=small).status == "failure"  # unknown batch size: assumed 64 MB
    assert doctor_run.check_shm(0, 8, 2, None, shm=small).status == "ok"  # no workers, no shared memory


def test_disk_space_for_checkpoints(tmp_path):
    report = run(tmp_path, disk_space=(GB, 3 * 2**20))
    check = by_name(report, "disk")[0]
    assert check.status == "failure" and "5 files ×" in check.detail and "keep_last" in check.fix
    assert doctor_run.check_disk(tmp_path, 10 * 2**20, 3, space=(GB, 70 * 2**20)).status == "warning"
    assert doctor_run.check_disk(tmp_path, 10 * 2**20, 3, space=(GB, GB)).status == "ok"


def test_cuda_visible_devices_sanity(monkeypatch):
    eight = GpuInventory(8, "nvidia-smi")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,9")
    check = doctor_host.check_visible_devices(eight, for_plan=False, gpus_needed=True)
    assert check.status == "failure" and "invalid device ordinal" in check.detail and "unset it" in check.fix
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert doctor_host.check_visible_devices(eight, for_plan=False, gpus_needed=True).status == "failure"
    assert doctor_host.check_visible_devices(eight, for_plan=False, gpus_needed=False).status == "warning"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    assert doctor_host.check_visible_devices(eight, for_plan=False, gpus_needed=True).status == "warning"
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert doctor_host.check_visible_devices(eight, for_plan=False, gpus_needed=True).status == "ok"
    assert (
        doctor_host.check_visible_devices(eight, for_plan=True, gpus_needed=True).status == "ok"
    )  # launch replaces it
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,9,2")
    assert doctor_host._visible_count(eight) == 2  # CUDA stops at the first invalid entry


def test_gpus_needed_versus_visible(tmp_path, monkeypatch):
    monkeypatch.setenv(FAKE_GPUS_ENV, "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    report = run(tmp_path, overrides=[f"run.dir={tmp_path / 'run'}", "run.device=cuda"], nproc=4)
    gpus = by_name(report, "GPUs")[0]
    assert gpus.status == "failure" and "the run needs 4" in gpus.detail and "--nproc 2" in gpus.fix
    assert not run(
        tmp_path, overrides=[f"run.dir={tmp_path / 'run'}"], nproc=2
    ).failed  # faked GPUs: the run is on the CPU


def test_plan_checks(tmp_path, monkeypatch):
    monkeypatch.setenv(FAKE_GPUS_ENV, "8")
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        f"runs_dir: {tmp_path / 'runs'}\n"
        f"jobs:\n  - {{name: a, task: toy, config: {TINY}, gpus: '0-3'}}\n  - {{name: b, task: toy, config: {TINY}, gpus: '3-4'}}\n"
    )
    report = doctor.run_doctor(plan=plan, shm_space=(8 * GB, 8 * GB), disk_space=(100 * GB, 50 * GB))
    problems = [c for c in report.checks if c.name == "plan"]
    assert report.failed and any("both use GPU 3" in c.detail for c in problems)
    plan.write_text(plan.read_text().replace("'3-4'", "'4-5'"))
    report = doctor.run_doctor(plan=plan, shm_space=(8 * GB, 8 * GB), disk_space=(100 * GB, 50 * GB))
    assert not report.failed, report.text()
    assert any(c.name == "job a: run dir" for c in report.checks) and any(
        c.name == "job b: disk" for c in report.checks
    )


def test_port_in_use_and_tmux_missing(monkeypatch):
    holder = socket.socket()
    holder.bind(("0.0.0.0", 0))
    holder.listen(1)
    try:
        port = holder.getsockname()[1]
        check = doctor_host.check_port(port, asked=True)
        assert check.status == "failure" and "in use" in check.detail
        assert doctor_host.check_port(port, asked=False).status == "warning"
    finally:
        holder.close()
    assert doctor_host.check_port(port, asked=True).status == "ok"
    monkeypatch.setattr(doctor_host.shutil, "which", lambda name: None)
    check = doctor_host.check_tmux(asked=True)
    assert check.status == "failure" and "without --tmux" in check.fix
    assert doctor_host.check_tmux(asked=False) is None


def _toy_checkpoint(path: Path, hidden: int, world_size: int = 2) -> Path:
    model = PointMLP(hidden=hidden)
    ck.save_checkpoint(
        path,
        {
            "task": "toy",
            "config": {"run": {"task": "toy"}},
            "model": {f"module.{k}": v for k, v in model.state_dict().items()},
            "ema": None,
            "optimizer": {"state": {}, "param_groups": []},
            "scheduler": {},
            "scaler": None,
            "progress": {"epoch": 1, "global_step": 8, "step_in_epoch": 0},
            "rng": {"world_size": world_size, "per_rank": []},
            "metrics": {},
        },
    )
    return path


def test_resume_checkpoint_compatibility(tmp_path):
    fits = _toy_checkpoint(tmp_path / "fits.pt", hidden=32)
    report = run(tmp_path, resume=str(fits), nproc=1)
    checks = by_name(report, "resume")
    assert [c.status for c in checks] == ["ok", "ok", "warning"], report.text()
    assert "written by 2 process(es), resuming on 1" in checks[2].detail
    report = run(tmp_path, resume=str(fits), overrides=[f"run.dir={tmp_path / 'run'}", "task.hidden=64"])
    bad = [c for c in by_name(report, "resume") if c.status == "failure"]
    assert bad and "do not fit the config's model" in bad[0].detail and "of another shape" in bad[0].detail
    torch.save({"model_state": PointMLP().state_dict()}, tmp_path / "foreign.pt")
    report = run(tmp_path, resume=str(tmp_path / "foreign.pt"))
    assert [c.status for c in by_name(report, "resume")] == ["failure"]
    (tmp_path / "cut.pt").write_bytes(fits.read_bytes()[:2000])
    report = run(tmp_path, resume=str(tmp_path / "cut.pt"))
    assert "truncated or corrupt" in by_name(report, "resume")[0].detail


def test_cli_exit_status(tmp_path):
    out = run_cli("doctor", "--config", str(TINY), f"run.dir={tmp_path / 'run'}")
    assert out.exit_code == 0, out.output
    out = run_cli("doctor", "--config", str(TINY), "--data", str(tmp_path / "missing"), f"run.dir={tmp_path / 'run'}")
    assert out.exit_code == 1 and "failure  dataset" in out.output
    out = run_cli("doctor", "--config", str(TINY), "--json", "optim.lrr=1")
    assert out.exit_code == 1 and any(
        c["name"] == "config" and c["status"] == "failure" for c in json.loads(out.output)
    )
