"""python -m unimem's parser: its subcommands, --version, the program it names, a help
text for every argument."""
import os
import subprocess
import sys

import pytest
from tests.helpers.cli import ROOT, unimem_cli


def test_help_lists_every_subcommand():
    done = unimem_cli("--help")
    assert done.returncode == 0
    for command in ("demo", "plot", "run", "summary", "stats", "cluster"):
        assert command in done.stdout
    assert unimem_cli().returncode == 2                    # a subcommand is required
    assert unimem_cli("teleport").returncode == 2


def test_usage_names_the_program():
    console = subprocess.run([sys.executable, "-c", "import sys; from unimem.cli.main import main; "
                              "sys.exit(main(['--help']))"], capture_output=True, text=True, timeout=120)
    assert console.returncode == 0 and console.stdout.startswith("usage: unimem "), console.stdout[:80]
    assert unimem_cli("--help").stdout.startswith("usage: python -m unimem ")
    bench = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], capture_output=True, text=True,
                           cwd=ROOT, timeout=120)
    assert bench.returncode == 0 and bench.stdout.startswith("usage: python -m benchmarks "), bench.stdout[:80]


def test_version_is_the_imported_packages():
    from importlib import metadata

    import unimem
    done = unimem_cli("--version")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert metadata.version("unimem") == unimem.__version__        # the build reads __version__
    assert done.stdout.startswith(f"unimem {unimem.__version__} from "
                                  f"{os.path.dirname(unimem.__file__)} (Python "), done.stdout
    assert done.stdout.count("\n") == 1
    console = subprocess.run([sys.executable, "-c", "import sys; from unimem.cli.main import main; "
                              "sys.exit(main(['--version']))"], capture_output=True, text=True, timeout=120,
                             cwd=ROOT)
    assert console.returncode == 0 and console.stdout == done.stdout, console


def test_version_from_a_source_tree_without_metadata(monkeypatch, capsys):
    from importlib import metadata

    import unimem
    from unimem.cli.main import main

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"unimem {unimem.__version__} (source tree, not installed) from ")


def _arguments_without_help(parser, path):
    import argparse
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helped = {choice.dest: choice.help for choice in action._choices_actions}
            for name, subparser in action.choices.items():
                if helped.get(name) in (None, argparse.SUPPRESS, ""):
                    yield f"{path} {name}"
                yield from _arguments_without_help(subparser, f"{path} {name}")
        elif action.help in (None, argparse.SUPPRESS, ""):
            yield f"{path}: {'/'.join(action.option_strings) or action.dest}"


def test_every_argument_of_every_subcommand_has_a_help_text():
    """run's SCRIPT had none (and run --abbreviated was hidden)."""
    from unimem.cli.main import build_parser
    assert list(_arguments_without_help(build_parser(), "unimem")) == []
    assert "the Python script to run" in unimem_cli("run", "--help").stdout


def test_version_says_when_the_installed_metadata_is_stale(monkeypatch, capsys):
    """An editable install made before the version changed: the imported
    package's version is printed, and the metadata's difference said."""
    from importlib import metadata

    import unimem
    from unimem.cli.main import main

    monkeypatch.setattr(metadata, "version", lambda name: "0.0.1")
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith(
        f"unimem {unimem.__version__} (the installed metadata says 0.0.1: reinstall) from ")
