"""The README runs as printed: its Python snippets run on the CPU (in a folder of their own,
with the test corpus as the default one), and every command line in its shell snippets is
one the command line takes (blujax's own commands parse with their parsers; scripts and
files it names exist)."""

import importlib.util
import os
import re
import shlex
from pathlib import Path

import pytest

from blujax.cli.parser import build_parser
from blujax.data.cli import build_parser as build_data_parser
from tests.test_gpt2_cli import _test_data, private_cache  # noqa: F401

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```", README, re.M | re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
SHELL = [code for lang, code in BLOCKS if lang == "bash"]


def _commands(code: str) -> list[list[str]]:
    """Each command of a shell snippet (continued lines joined, && split), as argv."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        for part in line.split("&&"):
            argv = shlex.split(part, comments=True)
            if argv:
                commands.append(argv)
    return commands


def test_the_readme_has_snippets():
    assert len(PYTHON) >= 2 and len(SHELL) >= 4
    assert README.count("\n") < 250


@pytest.mark.parametrize("argv", [argv for code in SHELL for argv in _commands(code)],
                         ids=lambda argv: " ".join(argv)[:60])
def test_every_shell_command_is_one_the_tools_take(argv):
    if argv[0] == "export":
        return  # an environment variable for the reader's own paths
    if Path(argv[0]).name == "python" or argv[0].endswith("/python"):
        if argv[1] == "-m" and argv[2] == "blujax.data":
            build_data_parser().parse_args(argv[3:])
        elif argv[1] == "examples/gpt2.py":
            build_parser().parse_args(argv[2:])
        elif argv[1] == "-m":
            assert importlib.util.find_spec(argv[2]) is not None, argv
        else:
            assert (ROOT / argv[1]).is_file(), argv
    elif argv[0] in ("bash", "pip"):
        if argv[0] == "bash":
            assert (ROOT / argv[1]).is_file(), argv
    else:
        assert (ROOT / argv[0]).is_file(), argv  # scripts/...


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_every_python_snippet_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BLUJAX_CORPUS", str(_test_data() / "tinyshakespeare.txt"))
    assert "xla_force_host_platform_device_count=8" in os.environ["XLA_FLAGS"]  # conftest's
    exec(compile(PYTHON[index], f"README.md python snippet {index + 1}", "exec"), {})
