"""The version of bertforge: written here once (pyproject.toml reads it).

Its own module so that the modules that report it need not import the package
that lazily imports them."""

__version__ = "0.1.0"
