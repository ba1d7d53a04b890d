"""LogThrottle (kv_transfer/log_throttle.py): the first warning is logged, the ones within `every_s` after it are
counted and left out, and the next one logged says how many were."""

from __future__ import annotations

import logging
import time

from llm_runtime.kv_transfer.log_throttle import LogThrottle


def test_a_flood_is_logged_once_a_period_with_the_count_left_out(caplog) -> None:
    logger = logging.getLogger("test_log_throttle")
    caplog.set_level("WARNING", logger=logger.name)
    throttle = LogThrottle(logger, every_s=0.2)
    for number in range(50):
        throttle.warning("refused %d", number)
    assert [record.getMessage() for record in caplog.records] == ["refused 0"]
    time.sleep(0.25)
    throttle.warning("refused %d", 50)
    assert caplog.records[-1].getMessage() == "refused 50 (49 more like it since the last one logged)"
