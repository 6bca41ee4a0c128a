"""stateguard's tools: the ``stateguard`` command line, ``check``, ``graph`` and the demo.

The library never imports this package; it is what the console script runs.
"""
