"""Every test here runs in a process the cpu hardware target has set up (as a job does)."""

import pytest

from ._helpers import single_process_group


@pytest.fixture(autouse=True, scope="session")
def _cpu_process_group():
    single_process_group()
