"""What the ``npattn`` command runs: ``cli`` (the command), ``audit`` (``npattn check``),
``demo`` (``npattn demo``), ``bench`` (``npattn bench``) and ``progress``.

Imports run one way: these modules use the library, and library code never
imports ``npattn.tools``.
"""
