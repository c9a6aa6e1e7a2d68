"""The installed package must contain every module: setuptools only ships the packages listed
in pyproject.toml (solvers/ and cli/ are mapped into recycle_planner by package-dir), and an
editable install would hide a missing one."""

import tomllib

from conftest import ROOT


def test_every_package_folder_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    found = set()
    for name, folder in mapping.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            sub = [p for p in rel.parts]
            if any(part.startswith((".", "__")) for part in sub):
                continue
            dotted = ".".join([name, *sub])
            # A sub-folder mapped on its own (recycle_planner.solvers) belongs to its mapping.
            if dotted in mapping and dotted != name:
                continue
            found.add(dotted)
    assert found == listed


def test_no_top_level_cli_or_solvers_module_is_installed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(p == "recycle_planner" or p.startswith("recycle_planner.")
               for p in config["packages"])
