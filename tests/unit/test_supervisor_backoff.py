"""`pdserve up` restart policy: backoff steps and exit reasons."""

from __future__ import annotations

import pytest

from serve.supervisor import exit_reason, restart_delay_s


@pytest.mark.parametrize(("failures", "delay"), [(0, 1.0), (1, 1.0), (2, 2.0), (3, 4.0),
                                                 (5, 16.0), (6, 30.0), (40, 30.0)])
def test_restart_delay_doubles_up_to_the_cap(failures: int, delay: float) -> None:
    assert restart_delay_s(failures) == delay


@pytest.mark.parametrize(("code", "text"), [(None, "running"), (0, "exit code 0"),
                                            (3, "exit code 3"), (-9, "killed by SIGKILL"),
                                            (-15, "killed by SIGTERM"),
                                            (-200, "killed by signal 200")])
def test_exit_reason(code: int | None, text: str) -> None:
    assert exit_reason(code) == text
