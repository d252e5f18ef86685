"""The version of kvcal, recorded in every artifact it writes, and of the transformers it runs with, where a release
changed what kvcal follows (read from the installed package's metadata: `import kvcal` stays light)."""

import functools
from importlib import metadata

from packaging.version import Version

__version__ = "0.1.0"


@functools.cache
def transformers_from(major: int, minor: int) -> bool:
    """Whether the installed transformers is release major.minor or later (its development builds included)."""
    return Version(metadata.version("transformers")).release >= (major, minor)
