"""The version of kvcal, recorded in every artifact it writes, and of the transformers it runs with, where a release
changed what kvcal follows (read from the installed package's metadata: `import kvcal` stays light)."""

import functools
from importlib import metadata

from packaging.version import Version

__version__ = "0.1.0"


def transformers_version() -> str:
    """The installed transformers' version."""
    return metadata.version("transformers")


@functools.cache
def transformers_from(major: int, minor: int) -> bool:
    """Whether the installed transformers is release major.minor or later (its development builds included)."""
    return Version(transformers_version()).release >= (major, minor)
