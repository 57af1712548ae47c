"""Without an optional extra, the code that needs it says which extra to install.

Run in a subprocess whose imports of the extra's packages fail as if they were not installed
(``notebook_site/sitecustomize.py``, the hiding the notebook tests use).
"""
import os
import subprocess
import sys

from _notebook_extras import ROOT, SITE_DIR

_WITHOUT_TUNIX = r"""
import sys
from specjax.rl import TunixPolicy  # the policy adapter needs no Tunix
try:
    from specjax.rl import SpeculativeRollout
except ModuleNotFoundError as e:
    print("rollout:", e.name, "|", e)
from experiments import rl
try:
    rl.run(None, "unused")  # fails on the missing extra before it reads the config
except ModuleNotFoundError as e:
    print("run:", e.name, "|", e)
"""


def test_rl_without_tunix_names_the_rl_extra():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SITE_DIR, ROOT]),
               SPECJAX_NOTEBOOK_BLOCK="tunix", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _WITHOUT_TUNIX], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert [line.split(" | ")[0] for line in out] == ["rollout: tunix", "run: tunix"], out
    for line in out:
        assert "pip install 'specjax[rl]'" in line, line
