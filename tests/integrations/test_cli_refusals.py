"""python -m unimem: a UNIMEM_ALLOC_CONF the pools or the device refuse, and an
output folder that cannot be made, are one line and a non-zero exit in every subcommand."""
import pytest
from tests.helpers.cli import accelerator_is_xpu, one_line_error, unimem_cli


@pytest.mark.parametrize("conf", ["max_split_size_mb:abc", "expandable_segments:True"])
def test_run_with_a_configuration_the_pools_refuse_stops_before_the_script(tmp_path, conf):
    """A malformed UNIMEM_ALLOC_CONF was swallowed by the dpnp hook (the run
    said it served dpnp, and every array bypassed the pools); on XPU,
    expandable_segments:True ended in a traceback of unimem's own frames.
    Both are now one line and exit status 2, before the script runs."""
    if conf.startswith("expandable") and not accelerator_is_xpu():
        pytest.skip("expandable segments are refused on XPU only")
    script = tmp_path / "script.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    done = unimem_cli("run", str(script), env={"UNIMEM_ALLOC_CONF": conf})
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "cannot serve arrays from unimem's pools" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "script.py.ran").exists()


POOL_COMMANDS = [("demo", "--steps", "1", "--no-oom", "--out", "OUT"), ("run", "SCRIPT"), ("summary",),
                 ("summary", "SCRIPT"), ("stats",), ("stats", "--json", "SCRIPT")]


@pytest.mark.parametrize("command", POOL_COMMANDS, ids=" ".join)
def test_a_malformed_alloc_conf_is_the_same_line_in_every_subcommand(tmp_path, command):
    """key=value for key:value: the parser's ValueError, with its hint, is
    one line and exit status 2 in each subcommand that uses the pools (the
    demo printed a traceback; summary and stats without a script went on)."""
    script = tmp_path / "script.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    argv = [{"SCRIPT": str(script), "OUT": str(tmp_path / "out")}.get(a, a) for a in command]
    done = unimem_cli(*argv, env={"UNIMEM_ALLOC_CONF": "max_split_size_mb=256"})
    line = one_line_error(done, "cannot serve arrays from unimem's pools",
                          "did you mean 'max_split_size_mb:256'?")
    assert line.startswith(f"python -m unimem {command[0]}: error: "), line
    assert done.stdout == "" and not (tmp_path / "script.py.ran").exists()


@pytest.mark.parametrize("command", [c for c in POOL_COMMANDS if "SCRIPT" in c or c[0] == "demo"],
                         ids=" ".join)
def test_a_setting_the_device_refuses_is_the_same_line_in_every_subcommand(tmp_path, command):
    """expandable_segments:True on XPU, which has no virtual memory to map:
    run said so in one line, the demo in a traceback of unimem's frames."""
    if not accelerator_is_xpu():
        pytest.skip("expandable segments are refused on XPU only")
    script = tmp_path / "script.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    argv = [{"SCRIPT": str(script), "OUT": str(tmp_path / "out")}.get(a, a) for a in command]
    done = unimem_cli(*argv, env={"UNIMEM_ALLOC_CONF": "expandable_segments:True"})
    line = one_line_error(done, "cannot serve arrays from unimem's pools", "expandable_segments:True")
    assert line.startswith(f"python -m unimem {command[0]}: error: "), line
    assert done.stdout == "" and not (tmp_path / "script.py.ran").exists()
    assert not (tmp_path / "out").exists(), "the demo made its folder before finding its pool refused"


def test_demo_into_a_folder_it_cannot_make_is_one_line_before_training(tmp_path):
    """--out under a file: the folder cannot be made, said before the training
    (it was a traceback after the whole run)."""
    (tmp_path / "a-file").write_text("")
    done = unimem_cli("demo", "--out", str(tmp_path / "a-file" / "demo"))
    one_line_error(done, "cannot write into", "Not a directory")
    assert done.stdout == ""
