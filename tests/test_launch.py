"""tests/launch.py, the tests' way to start Python programs: a forked program sees what the same command sees
(argv, ``__main__``, the first ``sys.path`` entries, a ``PYTHONPATH`` entry, the working directory, its exit
code and output), for ``python FILE``, ``-m``, ``-c`` and a console script of this environment; and a
``PYTHONPATH`` that would import other files than the server's makes it a real command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests import launch

PROBE = """import json, os, sys
import helper_mod
print(json.dumps({"argv": sys.argv, "main": __name__, "file": globals().get("__file__"),
                  "path": sys.path[:3], "helper": helper_mod.__file__, "cwd": os.getcwd()}))
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
"""


def both(cmd: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    return (launch.run(cmd, capture_output=True, text=True, timeout=60, **kwargs),
            subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kwargs))


def test_a_forked_program_sees_what_the_command_sees(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper_mod.py").write_text("")
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "probe_mod.py").write_text(PROBE)
    # the repository too (the tests' scripts import ``tests``), though the server's own path holds it already
    env = dict(os.environ, PYTHONPATH=f"{launch.ROOT}{os.pathsep}{tmp_path / 'lib'}", PROBE_EXIT="3")
    assert launch._forkable([sys.executable, "probe.py"], {"env": env})  # noqa: SLF001 -- else nothing is compared
    for cmd in ([sys.executable, str(tmp_path / "probe.py"), "a", "--b"], [sys.executable, "-m", "probe_mod", "x"],
                [sys.executable, "-c", PROBE, "y"]):
        forked, command = both(cmd, env=env, cwd=tmp_path)
        assert (forked.returncode, command.returncode) == (3, 3), (forked.stderr, command.stderr)
        assert json.loads(forked.stdout) == json.loads(command.stdout), cmd


def test_a_console_script_forks_as_the_kernel_runs_it(tmp_path: Path) -> None:
    """A script whose first line is ``#!`` and this interpreter, by path or by name on ``PATH``: forked as
    ``python SCRIPT`` (pip's console scripts are such files)."""
    script = tmp_path / "bin" / "probe-script"
    script.parent.mkdir()
    (tmp_path / "helper_mod.py").write_text("")
    script.write_text(f"#!{sys.executable}\n{PROBE}")
    script.chmod(0o755)
    env = dict(os.environ, PATH=f"{script.parent}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(tmp_path))
    for cmd in ([str(script), "z"], ["probe-script", "z"]):
        assert launch._through_interpreter(cmd, env) == [sys.executable, str(script), "z"]  # noqa: SLF001
        forked, command = both(cmd, env=env, cwd=tmp_path)
        assert forked.returncode == command.returncode == 0, (forked.stderr, command.stderr)
        assert json.loads(forked.stdout) == json.loads(command.stdout)


def test_a_pythonpath_that_shadows_a_preloaded_package_is_a_command(tmp_path: Path) -> None:
    (tmp_path / "omegaconf").mkdir()
    (tmp_path / "omegaconf" / "__init__.py").write_text("")
    shadowing = dict(os.environ, PYTHONPATH=str(tmp_path))
    repository = dict(os.environ, PYTHONPATH=str(launch.ROOT))  # the same lightning_par and tests as the server's
    assert not launch._forkable([sys.executable, "-c", "pass"], {"env": shadowing})  # noqa: SLF001
    assert launch._forkable([sys.executable, "-c", "pass"], {"env": repository})  # noqa: SLF001


def test_an_uncaught_exception_ends_as_in_the_command(tmp_path: Path) -> None:
    """Through ``sys.excepthook`` (the product installs one that prints a ConfigError in one line), exit 1;
    without a hook of the program's, the traceback."""
    hooked = "import sys\nsys.excepthook = lambda k, v, tb: print('hooked:', v, file=sys.stderr)\nraise ValueError('x')\n"
    for source in (hooked, "raise ValueError('plain')\n"):
        (tmp_path / "fail.py").write_text(source)
        forked, command = both([sys.executable, str(tmp_path / "fail.py")], cwd=tmp_path)
        assert forked.returncode == command.returncode == 1
        assert forked.stderr.strip().splitlines()[-1] == command.stderr.strip().splitlines()[-1], (forked.stderr,
                                                                                                 command.stderr)
