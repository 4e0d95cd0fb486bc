"""What the command line's tests share: running ``python -m unimem``, the
form of its one-line errors, and the small scripts they run under it."""
import os
import re
import subprocess
import sys
import textwrap

from tests.helpers import REPO_ROOT

ROOT = str(REPO_ROOT)


def unimem_cli(*args, cwd=None, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "unimem", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, timeout=timeout, env=dict(os.environ, **(env or {})))


def one_line_error(done, *needed, status=2):
    """The command failed with ``status`` and said why in one line, no
    traceback, in the form every subcommand's errors take (argparse's own):
    ``python -m unimem COMMAND: error: ...``."""
    assert done.returncode == status, (done.returncode, done.stdout, done.stderr)
    # argparse's usage (its first line "usage:", the lines it wraps onto indented) is not the error.
    usage = re.match(r"usage:.*\n(?:[ \t]+\S.*\n)*", done.stderr)
    after_usage = done.stderr[usage.end():] if usage else done.stderr
    lines = [line for line in after_usage.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert re.match(r"python -m unimem(?: [a-z]+)?: error: \S", lines[0]), lines[0]
    for text in needed:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def accelerator_is_xpu() -> bool:
    done = subprocess.run([sys.executable, "-c", "import unimem; print(unimem.accelerator.current_accelerator())"],
                          capture_output=True, text=True, timeout=300)
    return done.stdout.strip().startswith("xpu")


# A script that allocates 1000 bytes and 3 MiB from the current accelerator's
# pool, frees the first, and says so with its arguments.
WORKLOAD = textwrap.dedent("""
    import sys
    import unimem
    ptrs = [unimem.accelerator.caching_allocator_alloc(n) for n in (1000, 3 << 20)]
    unimem.accelerator.caching_allocator_delete(ptrs[0])
    print("workload ran with", sys.argv[1:])
""")


# The workload, saying something on stdout first: from Python and from file descriptor 1.
NOISY = "import sys, os\nprint('the script talks')\nos.write(1, b'and writes to fd 1\\n')\n" + WORKLOAD
