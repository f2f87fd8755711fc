"""The suite's shape (docs/development.md): tests mirror the package, so a module's tests are
found by its path; shared code lives in conftest.py and helper modules, never in a test module
another one imports."""
import ast
import pathlib

from tests.helpers import parse_python

ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
# folders that are not a package of moe_rl/: its top-level modules, runs through `moe-rl train`,
# SGLang's own code as the judge, the suite itself, and the project's other top-level folders
EXTRA = {"toplevel": "moe_rl/*.py", "loop": "moe-rl train end to end",
         "contract": "SGLang's code judging moe_rl", "suite": "the test suite",
         "kernels": "kernels/", "launch": "launch/", "benchmarks": "benchmarks/"}
PACKAGES = {p.parent.name for p in (ROOT / "moe_rl").glob("*/__init__.py")}


def misplaced(tests: pathlib.Path) -> list[str]:
    """Test modules not under tests/<a package of moe_rl or an EXTRA folder>/."""
    return [str(p.relative_to(tests)) for p in sorted(tests.rglob("test_*.py"))
            if p.parent == tests or p.relative_to(tests).parts[0] not in PACKAGES | set(EXTRA)]


def folders_without_init(tests: pathlib.Path) -> list[str]:
    folders = {p.parent for p in tests.rglob("test_*.py")} - {tests}
    return sorted(str(f) for f in folders if not (f / "__init__.py").is_file())


def imported_test_modules(tests: pathlib.Path) -> list[tuple[str, str]]:
    """(file, module) for every import of a test module or a conftest under ``tests``."""
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(parse_python(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [(str(path.relative_to(tests)), m) for m in names
                      if m.startswith("tests.")
                      and m.split(".")[-1].startswith(("test_", "conftest"))]
    return found


def test_every_test_module_sits_in_a_folder_named_for_what_it_tests():
    assert not misplaced(TESTS), f"test modules outside tests/<package>/: {misplaced(TESTS)}"
    assert not folders_without_init(TESTS), folders_without_init(TESTS)


def test_no_test_module_or_conftest_is_imported():
    offenders = imported_test_modules(TESTS)
    assert not offenders, f"import fixtures from conftest.py or a helper module: {offenders}"


def test_the_checks_see_a_flat_module_a_stray_folder_and_a_cross_import(tmp_path):
    (tmp_path / "test_flat.py").write_text("import os\n")
    (tmp_path / "misc").mkdir()
    (tmp_path / "misc" / "test_x.py").write_text("from tests.algo.test_losses import ref\n")
    (tmp_path / "algo").mkdir()
    (tmp_path / "algo" / "test_y.py").write_text("from tests.conftest import ROOT\n")
    assert misplaced(tmp_path) == ["misc/test_x.py", "test_flat.py"]
    assert folders_without_init(tmp_path) == [str(tmp_path / "algo"), str(tmp_path / "misc")]
    assert imported_test_modules(tmp_path) == [("algo/test_y.py", "tests.conftest"),
                                               ("misc/test_x.py", "tests.algo.test_losses")]
