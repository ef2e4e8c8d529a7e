"""torch is an optional extra: importing npattn never imports it, and interop says how to get it."""

import re
import subprocess
import sys
import textwrap


def _run(code):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_importing_npattn_does_not_import_torch():
    """``import npattn`` and every library module (interop and ``npattn.testing`` included)
    leave torch alone.

    Tools that compare against torch (benchmarks, scripts: ``npattn.tools``) may import it
    themselves; the library may not. ``npattn.testing`` is not imported by ``import npattn``
    (its strategies need hypothesis), so it is imported here by name.
    """
    r = _run(
        """
        import importlib, pkgutil, sys
        import npattn
        names = [m.name for m in pkgutil.walk_packages(npattn.__path__, "npattn.")
                 if not m.name.startswith(("npattn.tools", "npattn.__main__"))]
        for name in ("npattn.torch_interop", "npattn.testing", "npattn.testing.strategies"):
            assert name in names, (name, names)
        for name in names:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                if e.name != "hypothesis":  # the strategies' own optional dependency
                    raise
        bad = sorted(n for n in sys.modules if n == "torch" or n.startswith("torch."))
        assert not bad, bad
        print("ok", len(names))
        """
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_interop_without_torch_raises_import_error_naming_the_cpu_build():
    r = _run(
        """
        import sys
        sys.modules["torch"] = None  # as if torch were not installed
        import numpy as np
        from npattn import MultiHeadAttention
        m = MultiHeadAttention(4, 2)
        x = np.ones((1, 2, 4), dtype=np.float32)
        m(x, x, x)  # the module itself works without torch
        try:
            m.torch_state_dict()
        except ImportError as e:
            print("ImportError:", e)
        """
    )
    assert r.returncode == 0, r.stderr
    # the hint names the CPU pin, which is all the torch extra would add (torch>=2.5), and no
    # extra: npattn is not on PyPI, and an installed wheel has no checkout to install one from
    assert "ImportError:" in r.stdout and "pip install torch==2.13.0 for the CPU build" in r.stdout, r.stdout
    assert "[torch]" not in r.stdout and not re.search(r"npattn\[", r.stdout), r.stdout
