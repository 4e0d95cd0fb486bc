"""python -m unimem: what goes to stdout, what to stderr, what into files: one
thing on stdout, the script's output under ``run``, unimem's under ``summary`` and ``stats``."""
import json

from tests.helpers.cli import NOISY, one_line_error, unimem_cli


def test_stats_json_on_stdout_is_only_json(tmp_path):
    script = tmp_path / "noisy.py"
    script.write_text(NOISY)
    done = unimem_cli("stats", "--json", str(script))
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)                 # the whole of stdout
    assert view["memory_stats"]["allocation.all.allocated"] == 2
    assert "the script talks" in done.stderr and "and writes to fd 1" in done.stderr


def test_stats_into_a_file(tmp_path):
    script = tmp_path / "noisy.py"
    script.write_text(NOISY)
    out = tmp_path / "stats.json"
    done = unimem_cli("stats", "--json", "-o", str(out), str(script))
    assert done.returncode == 0, done.stderr
    assert "the script talks" in done.stdout
    assert json.loads(out.read_text())["memory_stats"]["allocated_bytes.all.current"] == 3 << 20
    one_line_error(unimem_cli("stats", "--json", "-o", str(tmp_path / "no" / "s.json")), "cannot write")


def test_run_keeps_the_summary_out_of_the_scripts_stdout(tmp_path):
    """run printed the summary into the script's own standard output; as
    ``time`` and profilers do, it now goes to stderr, and stdout holds the
    script's output alone (from Python and from file descriptor 1)."""
    script = tmp_path / "noisy.py"
    script.write_text(NOISY)
    done = unimem_cli("run", str(script), "--to-the-script")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "the script talks\nand writes to fd 1\nworkload ran with ['--to-the-script']\n"
    assert "memory summary" in done.stderr and "Allocated memory" in done.stderr


def test_run_output_writes_the_summary_into_a_file(tmp_path):
    script = tmp_path / "noisy.py"
    script.write_text(NOISY)
    summary = tmp_path / "summary.txt"
    done = unimem_cli("run", "-o", str(summary), str(script))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("the script talks\n") and "memory summary" not in done.stdout
    assert "memory summary" not in done.stderr
    text = summary.read_text()
    assert "memory summary" in text and "Allocated memory" in text
    # A file that cannot be written: refused before the script runs.
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    one_line_error(unimem_cli("run", "--output", str(tmp_path / "no" / "s.txt"), str(script)), "cannot write",
                   "no such folder")
    assert not marker.exists()


def test_summary_and_stats_keep_the_scripts_output_off_stdout(tmp_path):
    """Where unimem's own output is on stdout (summary's table, stats'
    figures), the script's output goes to stderr, as under stats --json."""
    script = tmp_path / "noisy.py"
    script.write_text(NOISY)
    for command, starts in (("summary", "|===="), ("stats", "device ")):
        done = unimem_cli(command, str(script))
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(starts) and "the script talks" not in done.stdout, done.stdout
        assert "the script talks" in done.stderr and "and writes to fd 1" in done.stderr
