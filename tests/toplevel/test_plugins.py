"""User code named in the configuration (``module:name``, moe_rl/plugins.py): found in the
directory moe-rl runs from, as the run's Ray actors find it, also where that directory is not on
the process's import path (the ``moe-rl`` console script)."""
import sys

import pytest

from moe_rl.plugins import load_named


def test_a_module_in_the_working_directory_is_found_without_it_on_the_path(tmp_path,
                                                                             monkeypatch):
    (tmp_path / "reward_in_cwd_7f3.py").write_text("def score(*a):\n    return 0.5\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    fn = load_named("reward_in_cwd_7f3:score", "data.reward", {}, "module:function")
    assert fn() == 0.5
    assert sys.path[-1] == str(tmp_path)   # last: an installed package is never shadowed
    monkeypatch.delitem(sys.modules, "reward_in_cwd_7f3")


def test_a_module_found_nowhere_is_refused_naming_the_key_and_leaves_the_path(tmp_path,
                                                                               monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = list(sys.path)
    with pytest.raises(ValueError, match=r"data.reward: cannot load 'absent_9c1:score': No "
                                         r"module named 'absent_9c1'"):
        load_named("absent_9c1:score", "data.reward", {}, "module:function")
    assert sys.path == before
