"""Settings shared by every test folder (``tests/`` and ``benchmarks/tests/``).

Its presence at the repository root also puts the root on ``sys.path``, so the benchmark tests
import the scripts as the ``benchmarks`` package.
"""

from __future__ import annotations

import os

from hypothesis import settings

# Property tests draw fresh examples on a developer's machine (more ground covered over time),
# but in CI they run derandomized: the same examples on every run, so a red build is reproducible
# and never caused by a lucky draw. No deadline anywhere: a loaded machine must not fail a test.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))
