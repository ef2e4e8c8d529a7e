"""torch is an optional extra: importing npattn never imports it, and interop says how to get it."""

import re
import subprocess
import sys
import textwrap

import pytest


def _run(code):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_importing_npattn_does_not_import_torch():
    """``import npattn`` and the library modules (interop included) leave torch alone.

    Tools that compare against torch (benchmarks, scripts) may import it
    themselves; the library may not.
    """
    r = _run(
        """
        import importlib, sys
        import npattn
        for name in ("backend", "functional", "module", "gradcheck", "masks", "torch_interop"):
            try:
                importlib.import_module("npattn." + name)
            except ModuleNotFoundError as e:
                if e.name != "npattn." + name:
                    raise
        bad = sorted(n for n in sys.modules if n == "torch" or n.startswith("torch."))
        assert not bad, bad
        print("ok")
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
