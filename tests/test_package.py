"""The package's shape, checked on its source: modules small enough to read, no side channels,
public names only outside the package, and a project that describes itself as it is now."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEXT = (".py", ".md", ".ipynb", ".toml", ".txt", ".css", ".sh", ".json")


def _files(*folders, suffixes=(".py",)):
  for folder in folders:
    for path in sorted((ROOT / folder).rglob("*")):
      if path.is_file() and path.suffix in suffixes and "_build" not in path.parts:
        yield path


def test_no_private_module_is_longer_than_500_lines():
  long = {p.name: n for p in _files("jaxcomp/_src")
          if (n := len(p.read_text().splitlines())) > 500}
  assert not long, long


def test_no_side_channels_in_the_package_or_the_benchmarks():
  # Private attributes of wrapped functions, and Python stack frames read in a collective's path.
  pattern = re.compile("__wrap" + "ped__|_get" + "frame")
  found = [f"{p.relative_to(ROOT)}:{i}" for p in _files("jaxcomp", "benchmarks")
           for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
  assert not found, found


def test_the_main_job_and_the_examples_use_public_names_only():
  pattern = re.compile(r"jaxcomp\._src|from jaxcomp\._src")
  found = [f"{p.relative_to(ROOT)}:{i}" for p in _files("jaxcomp/train", "examples", "notebooks",
                                                        suffixes=(".py", ".ipynb"))
           for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
  assert not found, found


def test_the_project_names_no_issue_numbers():
  # The project describes itself as it is now; its history lives in git.
  pattern = re.compile(r"\bissues? +#?[0-9]", re.IGNORECASE)
  roots = [ROOT / "README.md", ROOT / "BENCHMARKS.md"]
  found = [f"{p.relative_to(ROOT)}:{i}"
           for p in [*roots, *_files("jaxcomp", "docs", "benchmarks", "tests", "examples",
                                     "notebooks", ".ci", suffixes=TEXT)]
           for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
  assert not found, found
