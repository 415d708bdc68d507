"""This project's distribution: its name, its version, and how to install one of its extras.

The distribution is ``specdec-edgecloud``; ``specdec`` on PyPI is an unrelated project, and this one is installed
from a clone of its repository or from a wheel built from it, never by a bare name an index would resolve. Every
message that advises an install says it through :func:`install_command`. Imports nothing heavy (``import specdec``
and the CLI's one-line errors read it).
"""

from __future__ import annotations

DISTRIBUTION = "specdec-edgecloud"
WHEEL_PREFIX = "specdec_edgecloud"  # the wheel's file name spells the distribution with an underscore


def version() -> str | None:
    """The installed distribution's version, None when it is not installed (a source tree run as it is)."""
    from importlib.metadata import PackageNotFoundError, version as installed_version

    try:
        return installed_version(DISTRIBUTION)
    except PackageNotFoundError:
        return None


def install_command(extra: str) -> str:
    """How to install ``DISTRIBUTION[extra]``, in one line: editable from a clone, or from a built wheel (the
    wheel's version: the installed one, else a placeholder)."""
    wheel = f"dist/{WHEEL_PREFIX}-{version() or 'VERSION'}-py3-none-any.whl"
    return f"pip install -e '.[{extra}]' in a clone of the repository (or pip install '{wheel}[{extra}]')"
