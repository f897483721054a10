"""The e2e tests' jobs are jobs of their own: they never inherit the session's job id."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def _own_job_ids():
    """``SBLOADER_JOB_ID`` unset while an e2e module runs (its module fixtures start jobs too).

    ``tests/conftest.py``'s ``ray_session`` names the test process's job with it, for the ranks it
    simulates as threads; a torchrun job started after a ``ray/`` test inherited it, and its jobs then
    shared one job id: the second found the first's coordinator ("already exists for another loader").
    In CI's order ``e2e/`` runs first, so only another order (``pytest tests/ray tests/e2e``) showed it.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SBLOADER_JOB_ID", raising=False)
        yield
