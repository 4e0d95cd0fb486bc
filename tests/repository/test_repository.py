"""The repository's contract: CI runs exactly what the README tells users to run."""
import os
import re
from tests.helpers import REPO_ROOT

ROOT = str(REPO_ROOT)


def readme_commands():
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(r"```sh\n(.+?)\n```", f.read())


def test_readme_opens_with_the_two_commands():
    commands = readme_commands()
    assert len(commands) >= 2
    assert commands[0].endswith("python -m unimem demo")
    assert commands[1].endswith("python -m pytest")


def test_ci_runs_the_readme_test_command():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        script = f.read()
    assert readme_commands()[1] in script.splitlines()
