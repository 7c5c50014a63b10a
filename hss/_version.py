"""The version of hss, in one place (read by ``pyproject.toml`` and re-exported as ``hss.__version__``)."""

__version__ = "0.1.0"
