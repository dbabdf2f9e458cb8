"""The package's shape, checked on its source: modules small enough to read, no side channels,
public names only outside the package, and a project that describes itself as it is now."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEXT = (".py", ".md", ".ipynb", ".toml", ".txt", ".css", ".sh", ".json")


def _files(*folders, suffixes=(".py",)):
  for folder in folders:
    for path in sorted((ROOT / folder).rglob("*")):
      if path.is_file() and path.suffix in suffixes and "_build" not in path.parts:
        yield path


def test_no_file_of_the_package_benchmarks_or_tests_is_over_500_lines_or_100_characters_wide():
  files = list(_files("jaxcomp", "benchmarks", "tests"))
  long = {str(p.relative_to(ROOT)): n for p in files
          if (n := len(p.read_text().splitlines())) > 500}
  wide = [f"{p.relative_to(ROOT)}:{i}" for p in files
          for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > 100]
  assert not long and not wide, (long, wide)


def test_the_package_imports_no_module_that_imports_it_back():
  paths = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
           for p in _files("jaxcomp")}

  def imported(node):  # ``from P import a``: P.a where it is a module, else P
    if isinstance(node, ast.Import):
      return [a.name for a in node.names]
    return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module
            for a in node.names]

  imports = {module: {m for node in ast.walk(ast.parse(path.read_text()))
                      if isinstance(node, (ast.Import, ast.ImportFrom))
                      for m in imported(node) if m in paths and m != module}
             for module, path in paths.items()}

  def cycle_from(start, path):  # each cycle found from its first module in sorted order
    for following in sorted(imports[path[-1]]):
      if following == start:
        return path
      if following > start and following not in path and (found := cycle_from(
          start, path + [following])):
        return found
    return None

  cycles = [cycle for module in sorted(imports) if (cycle := cycle_from(module, [module]))]
  assert not cycles, cycles


def test_no_other_librarys_internals_are_read():
  # Misuse is found from the program (jaxcomp._src.misuse), never from frames, closures or code
  # objects; JAX's private modules are read in one module, with the versions it was checked on.
  sources = {p: p.read_text() for p in _files("jaxcomp")}
  assert not [p for p, text in sources.items()
              if re.search(r"f_locals|__closure__|__code__|ContextVar", text)]
  assert [p.name for p, text in sources.items() if "jax._src" in text] == ["jax_internals.py"]


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
