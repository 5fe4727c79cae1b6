"""The command line: thin wrappers, one clear line for user errors."""

import subprocess
import sys

from tests.helpers import run_cli_process, write_raw_dataset


def test_version_and_help():
    code, out, _ = run_cli_process("--version")
    assert code == 0 and out.startswith("pointforge ")
    code, out, _ = run_cli_process("--help")
    assert code == 0 and "data" in out and "demo" in out


def test_the_torchrun_worker_entry_ends_like_the_pointforge_command():
    for entry in ("pointforge",):
        proc = subprocess.run(
            [sys.executable, "-m", entry, "train", "nosuch"], capture_output=True, text=True, timeout=300
        )
        last = proc.stderr.strip().splitlines()[-1]
        assert (
            proc.returncode == 2
            and last
            == "error: unknown task 'nosuch'; available tasks: pcdiff, pcdiff_student, toy, unet, upsampler, voxelizer"
        )
        assert "Traceback" not in proc.stderr
        proc = subprocess.run(
            [sys.executable, "-m", entry, "train", "toy", "--bogus"], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 2 and "No such option: --bogus" in proc.stderr and "Traceback" not in proc.stderr


def test_a_full_disk_anywhere_is_one_line_not_a_traceback(capsys):
    import errno

    import typer

    from pointforge.cli.entry import run

    app = typer.Typer()

    @app.command()
    def write() -> None:
        try:  # as torch.save and the image writers report it: another error whose context is the OSError
            raise OSError(errno.ENOSPC, "No space left on device", "out/case/implant.nrrd")
        except OSError:
            raise RuntimeError("unexpected pos 128 vs 0")  # its context is the OSError

    assert run(app, []) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "no space left on the device while writing out/case/implant.nrrd; free some space" in err


def test_prepare_command_and_bad_inputs(tmp_path):
    raw = write_raw_dataset(tmp_path / "raw", "skullfix", n_skulls=2)
    code, out, err = run_cli_process(
        "data", "prepare", raw, "--out", tmp_path / "prep", "--points", 1500, "--workers", 1
    )
    assert code == 0, err
    assert "skullfix: 2 cases" in out and (tmp_path / "prep/cases.csv").exists()

    code, _, err = run_cli_process("data", "prepare", tmp_path / "nowhere", "--out", tmp_path / "x")
    assert code == 2 and err.strip().count("\n") == 0 and "no such folder" in err

    code, _, err = run_cli_process("data", "prepare", raw, "--out", tmp_path / "x", "--split", "a,b")
    assert code == 2 and "split ratios" in err and "Traceback" not in err


def test_prepare_command_exits_nonzero_listing_failures(tmp_path):
    raw = write_raw_dataset(tmp_path / "raw", "skullfix", n_skulls=2)
    bad = raw / "implant/001.nrrd"
    bad.write_bytes(b"NRRD0004\ngarbage")
    code, out, err = run_cli_process(
        "data", "prepare", raw, "--out", tmp_path / "prep", "--points", 1500, "--workers", 1
    )
    assert code == 1
    assert "1 failed" in out and str(bad) in err
    assert (tmp_path / "prep/surfaces/defective_skull/001.npy").exists()
