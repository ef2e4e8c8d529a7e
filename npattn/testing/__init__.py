"""Test helpers for your own attention kernels.

* ``assert_attention_close(fn, **verify_kwargs)``: ``npattn.verify`` as a
  pytest assertion; the ``AssertionError`` carries the report's table, the
  failing cases, their hints and reproducers;
* ``npattn.testing.strategies``: hypothesis strategies that draw
  ``npattn.verify_cases.Case`` objects (shapes, masks, options) for
  ``assert_attention_close(fn, cases=[case], ...)``. It imports hypothesis,
  so it is imported on its own: ``from npattn.testing import strategies``.
"""

from __future__ import annotations

from typing import Any, Callable

from ..validation import check_bool
from ..verifier import VerifyReport, verify

__all__ = ["assert_attention_close"]


def assert_attention_close(fn: Callable, *, allow_degenerate: bool = True,
                           **verify_kwargs: Any) -> VerifyReport:
    """Run ``npattn.verify(fn, **verify_kwargs)``; raise ``AssertionError`` unless it passes.

    Parameters
    ----------
    fn : callable
        Your attention, as ``npattn.verify`` takes it.
    allow_degenerate : bool
        False also fails a case with a degenerate tensor (one the check
        cannot tell right from wrong), e.g. to make sure a hypothesis-drawn
        case tests what it should.
    **verify_kwargs
        ``layout``, ``dtype``, ``supports``, ``backward``, ``autograd``,
        ``returns_lse``, ``mask_grad``, ``lse_grad``, ``cases``, ... as ``npattn.verify``.

    Returns
    -------
    VerifyReport
        When it passes.

    Examples
    --------
    >>> from npattn import functional as F
    >>> def mine(q, k, v, **options):
    ...     return F.sdpa_forward(q, k, v, **options)[0]
    >>> report = assert_attention_close(mine, dtype="float64", cases=["base-1x65"])
    >>> report.ok
    True
    """
    check_bool("allow_degenerate", allow_degenerate)  # before verify's cases run
    report = verify(fn, **verify_kwargs)
    degenerate = [r for r in report.results if r.status == "degenerate"]
    if report.ok and (allow_degenerate or not degenerate):
        return report
    text = report.format()
    if report.ok:
        names = ", ".join(r.case.name for r in degenerate)
        text += f"\n\nallow_degenerate=False and {len(degenerate)} case(s) are degenerate: {names}"
    raise AssertionError("attention kernel disagrees with npattn\n" + text)
