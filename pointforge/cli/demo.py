"""`pointforge demo`."""

from __future__ import annotations

from pathlib import Path

import typer

from pointforge.cli.progress import Bars
from pointforge.implant.demo.budget import DEFAULT_MINUTES, DEFAULT_SKULLS

_STAGES = {
    "prepare": "prepare skulls",
    "probe": "probe on validation (cases)",
    "generate": "generate implants (cases)",
    "score": "score (cases)",
    "oracle": "oracle (cases)",
    "baseline": "baseline (cases)",
    "student": "generate test implants with the few-step student (cases)",
}


class _StageBars:
    """The demo's ``progress(stage, done, total, info)`` as bars: one per network while training
    (seconds of the time budget, its step count, the time left), then one per stage counting cases."""

    def __init__(self) -> None:
        self.bars = Bars()
        self.count = 0
        self.current: str | None = None
        self.train_done = -1.0

    def __enter__(self):
        self.bars.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bars.__exit__(*exc)

    def __call__(self, stage: str, done: float, total: float, info) -> None:
        if stage == "train":
            if done < self.train_done or self.current != "train":  # a new training phase
                self.count += 1
            self.current, self.train_done = "train", done
            for name, state in (info or {}).items():
                step, until = state["step"], state["until"]
                said = f"step {step if step is not None else '…'}"
                if until is None:  # a time budget: seconds of it
                    done_of, said_of = (round(done), round(total)), said
                else:  # a step budget (--train-steps): its steps, so the time left is the steps'
                    done_of, said_of = (step or 0, until), f"{said} of {until:,}"
                self.bars.update(
                    f"{self.count} {name}", done_of[0], total=done_of[1], description=f"train {name}", detail=said_of
                )
            return
        if stage != self.current:
            self.count += 1
            self.current = stage
        description = _STAGES.get(stage, stage)
        if stage == "generate" and info is not None:
            description = f"generate test implants with the models after {info} (cases)"
        if stage == "probe" and info is not None:
            description = f"probe the models after {info} on validation (cases)"
        self.bars.update(f"{self.count} {stage}", done, total=total, description=description)


def _step_pair(text: str) -> tuple[int, int]:
    from pointforge.errors import UserError

    try:
        pcdiff, voxelizer = (int(v) for v in text.split(","))
    except ValueError:
        raise UserError(
            f"--train-steps {text!r}: give two step counts, PCDiff's and the voxelizer's, e.g. 600,600"
        ) from None
    return pcdiff, voxelizer


def _student_calls(distill: bool, calls: int | None) -> int:
    """The student's network calls: ``--distill-calls`` (1 or 2), else 1 with ``--distill``, else 0 (none)."""
    from pointforge.errors import UserError

    if calls is None:
        return 1 if distill else 0
    if calls not in (1, 2):
        raise UserError(f"--distill-calls must be 1 or 2 (the student's network calls per proposal), got {calls}")
    return calls


# The options whose help runs past a line, so that `demo` stays a screen long.
_HELP = {
    "split": "With --data: train,val,test ratios, skull ids (train=000-059,val=060-069,test=070-079; "
    "skulls not named are never read) or a named split (skullfix). Default 0.625,0.125,0.25.",
    "train_steps": "PCDIFF,VOXELIZER: train to these step counts instead of --minutes (the same models on any "
    "machine, whatever its load; for comparisons at equal budget).",
    "config": "The packaged preset both networks train from: demo (minutes on a CPU) or skullfix (real skulls, "
    "docs/implant.md).",
    "data": "A raw SkullBreak or SkullFix folder (any size or spacing), or a folder `data prepare` wrote from one, "
    "to run on instead of synthetic skulls (--family, --skulls and --size then do not apply).",
    "distill": "After the test cases, distil the chosen PCDiff into a 1-call student (for its packaged "
    "pcdiff_student preset's steps), generate and score the test cases with it, and report what it cost and "
    "changed. With --resume, adds the student to a finished demo.",
    "resume": "Finish the run an earlier demo began in --out (stopped, killed, out of time), with the same options: "
    "the prepared data, the trained phases and the written test cases are kept (--distill may be added).",
}


def demo(
    out: Path = typer.Option(Path("demo_out"), "--out", help="New or empty folder for everything the demo writes."),
    minutes: float = typer.Option(
        DEFAULT_MINUTES, "--minutes", help="Training wall-clock budget (PCDiff and voxelizer side by side)."
    ),
    family: str = typer.Option(
        "anatomical", "--family", help="Synthetic skull family: anatomical (a real head, deformed) or domes (fast)."
    ),
    skulls: int = typer.Option(
        DEFAULT_SKULLS, "--skulls", help="Synthetic skulls (5 defect cases each), split 10:2:4 by skull."
    ),
    size: int = typer.Option(64, "--size", help="Volume size S (S³ voxels over a 230 mm field of view)."),
    ensemble: int = typer.Option(5, "--ensemble", help="Implant proposals per case."),
    sampler: str = typer.Option("dpm++2m", "--sampler", help="ddpm, ddim or dpm++2m."),
    steps: int = typer.Option(20, "--steps", help="Sampler steps (ignored by ddpm)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    seed: int = typer.Option(0, "--seed"),
    split: str = typer.Option(None, "--split", help=_HELP["split"]),
    train_steps: str = typer.Option(None, "--train-steps", help=_HELP["train_steps"]),
    config: str = typer.Option("demo", "--config", help=_HELP["config"]),
    reach_mm: float = typer.Option(
        None, "--reach-mm", help="Keep implant voxels within this many mm of the generated points (as generate)."
    ),
    skull_points: int = typer.Option(
        None,
        "--skull-points",
        help="Defective-skull points the voxelizer is given beside the implant points (as generate).",
    ),
    data: Path = typer.Option(None, "--data", help=_HELP["data"]),
    distill: bool = typer.Option(False, "--distill", help=_HELP["distill"]),
    distill_calls: int = typer.Option(
        None, "--distill-calls", help="The student's network calls per proposal, 1 or 2 (implies --distill)."
    ),
    resume: bool = typer.Option(False, "--resume", help=_HELP["resume"]),
) -> None:
    """The whole system on synthetic data (or your own, --data): data → training → implants → evaluation against a baseline and an oracle → report."""
    calls = _student_calls(distill, distill_calls)  # refused before the demo's modules (and torch) load
    from pointforge.implant.demo.run import run_demo
    from pointforge.implant.demo.settings import DemoSettings

    settings = DemoSettings(
        minutes=minutes,
        family=family,
        skulls=skulls,
        size=size,
        ensemble=ensemble,
        sampler=sampler,
        steps=None if sampler == "ddpm" else steps,
        device=device,
        seed=seed,
        data=None if data is None else str(data),
        config=config,
        reach_mm=reach_mm,
        skull_points=skull_points,
        train_steps=None if train_steps is None else _step_pair(train_steps),
        split=DemoSettings.split if split is None else split,
        distill=calls,
    )
    with _StageBars() as bars:
        result = run_demo(out, settings, log=typer.echo, progress=bars, resume=resume)
    _say_result(result, typer.echo)


def _say_result(result, say) -> None:
    """The demo's last lines: the means against the baseline and the oracle, and where the report is."""
    from pointforge.implant.demo.report_tables import format_score
    from pointforge.implant.demo.training import phase_name

    s = result.summary
    chosen = s["curve"][s["chosen"]]
    beaten = [e["label"] for m, e in s["intervals"].items() if s["beats_baseline"][m]]
    say(
        f"mean DSC on {len(s['cases'])} test cases: PCDiff pipeline {format_score(s['pipeline_dsc_mean'])} "
        f"(the models after {phase_name(chosen['minutes'], chosen['steps'], bool(s['settings'].get('train_steps')))}, "
        "chosen on the validation cases), "
        f"baseline {format_score(s['baseline_dsc_mean'])}, oracle {format_score(s['oracle_dsc_mean'])}; "
        f"baseline beaten (95 % paired interval) on: {', '.join(beaten) or 'none'}; "
        f"total {s['timings_s']['total_s'] / 60:.1f} min"
    )
    if "student" in s:
        say(_student_line(s))
    say(f"report: {result.report_html} (and {result.report_md.name})")


def _student_line(s: dict) -> str:
    """The few-step student's line: its DSC beside the pipeline's, the paired difference, its cost and speed."""
    from pointforge.implant.demo.report_tables import format_score

    st = s["student"]
    d = st["intervals"]["dsc"]["difference"]
    sampling = st["sample_s_per_case"]
    return (
        f"{st['calls']}-call student ({st['steps']} steps, {st['training_minutes']:.1f} min to distil): mean DSC "
        f"{format_score(st['dsc_mean'])} against the pipeline's {format_score(s['pipeline_dsc_mean'])} "
        f"(student − pipeline {format_score(d['mean'])} [{format_score(d['low'])}, {format_score(d['high'])}], "
        f"paired 95 %); sampling {format_score(sampling['student'], 2)} s per case against "
        f"{format_score(sampling['pipeline'], 2)} s"
    )
