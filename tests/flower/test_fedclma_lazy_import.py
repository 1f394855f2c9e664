"""``from clma import CLMA`` (fed-clma's import) is lazy: ``import clma`` stays cheap and
Flower-free; touching CLMA without flwr names the extra to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "flows" / "flower_app"

_BLOCK_FLWR = "import sys; sys.modules['flwr'] = None\n"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_import_clma_imports_nothing_heavy():
    out = _run("import sys, clma\n"
               "heavy = [m for m in ('flwr', 'torch', 'numpy', 'clma.flower', 'clma.params',"
               " 'clma.cohort', 'sklearn') if m in sys.modules]\n"
               "print(heavy)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_clma_without_flower_imports_and_clma_CLMA_names_the_extra():
    out = _run(_BLOCK_FLWR + "import clma\n"
               "from clma import LastLayers, InferenceDriftMonitor\n"
               "try:\n    clma.CLMA\nexcept ImportError as e:\n    print('ERR', e)\n")
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout and "pip install 'clma[flower]'" in out.stdout
    out = _run(_BLOCK_FLWR + "from clma import CLMA\n")
    assert out.returncode != 0 and "pip install 'clma[flower]'" in out.stderr


def test_from_clma_import_CLMA_is_the_flower_strategy():
    from clma import CLMA
    from clma.flower.strategy import CLMA as Strategy

    assert CLMA is Strategy
    import clma

    assert "CLMA" in dir(clma) and set(clma.__all__) <= set(dir(clma))
    try:
        clma.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("unknown names must raise AttributeError")


def test_the_clientapp_module_imports_no_scipy_torch_or_server_side():
    # Flower starts one flwr-clientapp process per message, and each imports the app: the
    # secure-aggregation steps must not pay for scipy, torch or scikit-learn (the learner
    # imports them when a train or advertise message builds it), nor ever for the server side
    out = _run("import sys\n"
               f"sys.path.insert(0, {str(APP)!r})\n"
               "import clma_clientapp, clma.device, clma.privacy.secagg\n"
               "heavy = [m for m in ('scipy', 'torch', 'sklearn', 'prefect', 'mlflow', 'pandas')"
               " if m in sys.modules]\n"
               "print(heavy)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
