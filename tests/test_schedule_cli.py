"""`loom schedule`: the printed schedule, its figures, the chart, and the measured timeline of a run."""

import json

from training_runs import loom_here, one_line_error, tiny_train_args


def test_prints_schedule_bubble_and_memory(tmp_path, capfd):
    result = loom_here(capfd, "schedule", "--pp", "4", "--microbatches", "8", "--output", str(tmp_path / "s.png"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1] == "rank 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert lines[4] == "rank 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    assert "bubble: 0.3750 of the ideal compute time (theory (P-1)/(V*M) = 0.3750); 27.3% of the step is idle" in (
        result.stdout
    )
    assert "per rank (micro-batches of one stage): 4, 3, 2, 1" in result.stdout
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_rejects_what_the_interleaved_schedule_cannot_run(capfd):
    result = loom_here(capfd, "schedule", "--pp", "4", "--vp", "2", "--microbatches", "6")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: the interleaved schedule needs microbatches divisible by pp = 4")


def test_from_run_draws_the_measured_timeline(markov_dataset, tmp_path, capfd):
    run = tmp_path / "run"
    result = loom_here(
        capfd,
        "train",
        *tiny_train_args(
            markov_dataset(60),
            run,
            "--nproc",
            "2",
            "--parallel.pp",
            "2",
            "--train.steps",
            "2",
            "--train.record_pipeline_timeline",
            "true",
        ),
    )
    assert result.returncode == 0, result.stderr
    timeline = json.loads((run / "pipeline_timeline.json").read_text())
    assert timeline["layout"] == {"pp": 2, "vp": 1, "microbatches": 8}
    assert [len(rank) for rank in timeline["ranks"]] == [16, 16]
    result = loom_here(capfd, "schedule", "--from-run", str(run))
    assert result.returncode == 0, result.stderr
    assert (run / "pipeline_schedule.png").exists()
    # the layout given beside it was ignored (pp=2 drawn, exit 0)
    conflicting = loom_here(capfd, "schedule", "--from-run", str(run), "--pp", "4", "--microbatches", "8")
    one_line_error(conflicting, "--from-run draws the run's own layout; drop --parallel.pp (--pp) and --microbatches")


def test_a_chart_never_replaces_a_file_loom_did_not_draw(tmp_path, capfd):
    """`schedule --output` and `plan --plot` wrote over any file given (a photo named user.png, exit 0)."""
    schedule = ["schedule", "--pp", "2", "--microbatches", "4", "--output"]
    plan = ["plan", "--config", "tiny", "--gpus", "8", "--top", "1", "--plot"]
    mine = tmp_path / "user.png"
    mine.write_bytes(b"my photo")
    for argv, flag in ((schedule, "--output"), (plan, "--plot")):
        refused = loom_here(capfd, *argv, str(mine))
        one_line_error(refused, f"{flag} {mine} exists and is not a chart `loom {argv[0]}` drew", "pass --overwrite")
        assert mine.read_bytes() == b"my photo" and not refused.stdout  # refused before the work
    for suffix in (".png", ".pdf", ".svg"):  # a rerun redraws its own chart, in every format, and only its own
        for argv in (schedule, plan):
            chart = tmp_path / f"{argv[0]}{suffix}"
            for _ in range(2):
                result = loom_here(capfd, *argv, str(chart))
                assert result.returncode == 0, result.stderr
        drawn = (tmp_path / f"schedule{suffix}").read_bytes()  # `loom plan` drew over a schedule, exit 0
        one_line_error(loom_here(capfd, *plan, str(tmp_path / f"schedule{suffix}")), "not a chart `loom plan` drew")
        assert (tmp_path / f"schedule{suffix}").read_bytes() == drawn
    words = tmp_path / "notes.svg"  # loom's words in a file that is no chart
    words.write_text("these were drawn by loom, by hand")
    one_line_error(loom_here(capfd, *schedule, str(words)), "is not a chart `loom schedule` drew")
    link = tmp_path / "link.svg"  # written through, as other programs write to a link (it became a file)
    link.symlink_to(tmp_path / "schedule.svg")
    assert loom_here(capfd, *schedule, str(link)).returncode == 0 and link.is_symlink()
    assert loom_here(capfd, *schedule, str(mine), "--overwrite").returncode == 0
    assert mine.read_bytes()[:4] == b"\x89PNG" and [p.name for p in tmp_path.glob(".*")] == []
    unwritable = loom_here(capfd, *plan, "/proc/chart.png")
    one_line_error(unwritable, "--plot /proc/chart.png: cannot write there")
    assert not unwritable.stdout  # said before the table, not after it


def test_a_timeline_loom_did_not_write_is_one_line(tmp_path, capfd):
    timeline = tmp_path / "pipeline_timeline.json"
    for text, error in (("garbage", "JSONDecodeError"), ("{}", "KeyError: 'layout'")):
        timeline.write_text(text)
        one_line_error(
            loom_here(capfd, "schedule", "--from-run", str(tmp_path)),
            f"{timeline} is not a pipeline timeline loom wrote ({error}",
        )
