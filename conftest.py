"""Settings shared by every test folder (``tests/`` and ``benchmarks/tests/``).

Its presence at the repository root also puts the root on ``sys.path``, so the benchmark tests
import the scripts as the ``benchmarks`` package.
"""

from __future__ import annotations

import os
import tempfile

from hypothesis import settings

# Compression times that runs measure are cached in a file (gradzip.plan.TimingCache): the
# tests' go to a file of this session's own, never to the user's cache, and the processes
# the tests start inherit it.
if not os.environ.get("GRADZIP_PLAN_TIMINGS"):
    os.environ["GRADZIP_PLAN_TIMINGS"] = os.path.join(
        tempfile.mkdtemp(prefix="gradzip-test-timings-"), "plan-timings.json")

# Property tests draw fresh examples on a developer's machine (more ground covered over time),
# but in CI they run derandomized: the same examples on every run, so a red build is reproducible
# and never caused by a lucky draw. No deadline anywhere: a loaded machine must not fail a test.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))
