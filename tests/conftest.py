"""Settings for the whole suite."""

from __future__ import annotations

from hypothesis import settings

# No per-example deadline: hypothesis' default (200 ms) is a wall-clock bar, and on a shared
# 2-core machine an example of test_pair_is_distinct_and_allowed took longer under load and
# failed the run. Property tests here assert behaviour, never speed.
settings.register_profile("pdserve", deadline=None)
settings.load_profile("pdserve")
