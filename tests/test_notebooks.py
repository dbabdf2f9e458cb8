"""The notebooks execute from top to bottom in a fresh python3 kernel (nbclient)."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def execute(name, monkeypatch):
  monkeypatch.setenv("PYTHONPATH", ROOT)  # the kernel inherits it and imports this checkout
  monkeypatch.setenv("MPLBACKEND", "Agg")
  path = os.path.join(ROOT, "notebooks", name)
  book = nbformat.read(path, as_version=4)
  assert not any(cell.get("outputs") for cell in book.cells), f"{name} is stored with outputs"
  NotebookClient(book, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": ROOT}}).execute()
  return "\n".join(out.get("text", "") for cell in book.cells if cell.cell_type == "code"
                   for out in cell.outputs)


@pytest.mark.slow
def test_quickstart_notebook_executes_and_reports_bytes_and_each_compressors_loss(monkeypatch):
  text = execute("quickstart.ipynb", monkeypatch)
  assert "collectives on one device: 0" in text
  assert "in 5 steps PowerSGD sent" in text
  for name in ("allreduce", "fp16", "powersgd rank 1"):
    assert f"{name}: loss after 5 steps" in text


@pytest.mark.slow
def test_compare_compressors_notebook_executes_and_tabulates_four_compressors(monkeypatch):
  text = execute("compare_compressors.ipynb", monkeypatch)
  assert "| compressor | sent/step/device |" in text
  for name in ("allreduce", "powersgd_r1", "dgc", "coarse_dgc"):
    assert f"| {name} |" in text
