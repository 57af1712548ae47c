"""Executes notebooks/drafter_quicktour.ipynb headless (nbclient; the same as
``pytest --nbmake notebooks/drafter_quicktour.ipynb``) in its small (tiny) mode."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "drafter_quicktour.ipynb")


@pytest.mark.xdist_group("tiny_target")  # shares the cached tiny target with the driver test
def test_drafter_quicktour_runs(tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    saved = {k: os.environ.get(k) for k in ("SPECJAX_NOTEBOOK_WORKDIR", "XLA_FLAGS")}
    os.environ["SPECJAX_NOTEBOOK_WORKDIR"] = str(tmp_path)
    # the kernel is a fresh process: give it the one CPU device of a user's session, not the
    # 8 fake devices of tests/conftest.py
    os.environ["XLA_FLAGS"] = " ".join(f for f in (saved["XLA_FLAGS"] or "").split()
                                       if "xla_force_host_platform_device_count" not in f)
    try:
        client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                         resources={"metadata": {"path": os.path.dirname(
                                             NOTEBOOK)}})
        client.execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
    assert "predicted 1 + sum prod alpha" in outputs
    assert os.path.exists(tmp_path / "eval" / "acceptance_per_position.png")
