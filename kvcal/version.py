"""The version of kvcal, recorded in every artifact it writes."""

__version__ = "0.1.0"
