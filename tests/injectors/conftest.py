"""Fixtures shared with other test packages."""

from tests.disk_fixtures import run_root  # noqa: F401 - the disk-fault tests' always-clean-up run directory
