"""`litevlm bench --study NAME`: the measuring studies (bench/studies/) as a user finds and runs them.
Each study's own behaviour is tested beside it (test_cpu_stages_script.py, test_lowbit_decode_script.py,
test_ros_launch_real.py); here: every module is listed, each answers --help under the command's name,
and an unknown name is refused with the list."""

from __future__ import annotations

import pkgutil

import pytest

import litevlm_runtime.bench.studies as studies_package
from litevlm_runtime.cli import main

MODULES = sorted(m.name for m in pkgutil.iter_modules(studies_package.__path__))


def test_the_list_names_every_study_with_its_question(capsys):
    assert main(["bench", "--study", "list"]) == 0
    listed = capsys.readouterr().out
    assert main(["bench", "--study"]) == 0
    assert capsys.readouterr().out == listed
    names = [line.split()[0] for line in listed.splitlines()[1:] if line.startswith("  ") and line[2] != " "]
    assert names == MODULES and len(MODULES) >= 12
    assert all(studies_package.studies()[name] for name in MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_each_study_shows_its_own_flags_under_the_command(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--study", name, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: litevlm bench --study {name} ")


def test_an_unknown_study_is_refused_with_the_list(capsys):
    assert main(["bench", "--study", "no_such_study"]) == 2
    err = capsys.readouterr().err
    assert "--study no_such_study: no such study" in err and "cpu_stages" in err
