"""bench/overlap_summary.py on a glob that also matches files that are not `bench overlap
--json` results (docs/overlap.md's r*.json next to docs/tuning.md's run2.json)."""
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "bench", "overlap_summary.py")
RESULTS = os.path.join(REPO, "bench", "results")


def summary(*paths):
    return subprocess.run([sys.executable, SCRIPT, *map(str, paths)], capture_output=True,
                          text=True, timeout=120, cwd=REPO)


def test_files_that_are_not_overlap_results_are_skipped_and_named(tmp_path):
    r1, r2 = tmp_path / "r1.json", tmp_path / "r2.json"
    shutil.copy(os.path.join(RESULTS, "overlap_resnet50_run1.json"), r1)
    shutil.copy(os.path.join(RESULTS, "overlap_resnet50_run2.json"), r2)
    table = tmp_path / "run2.json"                     # a `bench crossover --json` tuning table
    shutil.copy(os.path.join(RESULTS, "crossover_2ranks.json"), table)
    broken = tmp_path / "rx.json"
    broken.write_text('{"model": "resnet50", "runs": [')
    rows = tmp_path / "ry.json"
    rows.write_text('{"model": "resnet50", "runs": [{"policy": "osf"}]}')
    alone = summary(r1, r2)
    assert alone.returncode == 0 and alone.stderr == "", alone.stderr
    assert "## resnet50: median over 2 runs" in alone.stdout
    mixed = summary(r1, table, broken, r2, rows)
    assert mixed.returncode == 0, mixed.stderr
    assert mixed.stdout == alone.stdout                # the skipped files change nothing
    lines = mixed.stderr.splitlines()
    assert len(lines) == 3, mixed.stderr
    assert lines[0].startswith(f"overlap_summary.py: skipping {table}: not a `bench overlap "
                               f"--json` result"), lines[0]
    assert "sizes" in lines[0]                          # what the file has instead
    assert lines[1].startswith(f"overlap_summary.py: skipping {broken}: not JSON"), lines[1]
    assert lines[2].startswith(f"overlap_summary.py: skipping {rows}: a row of \"runs\" lacks "
                               f"one of policy, measured, predicted, model"), lines[2]


def test_nothing_to_summarise_is_an_error(tmp_path):
    table = tmp_path / "run4.json"
    shutil.copy(os.path.join(RESULTS, "crossover_4ranks.json"), table)
    missing = tmp_path / "r9.json"
    proc = summary(table, missing)
    assert proc.returncode == 1 and proc.stdout == ""
    assert f"skipping {table}: not a `bench overlap --json` result" in proc.stderr
    assert f"skipping {missing}: No such file or directory" in proc.stderr
    assert "no `bench overlap --json` results among the 2 file(s) given" in proc.stderr
