"""Whether Lightning's loggers write on this step: a Lightning-only helper with no lightning_par import,
so the models (layer 3) and the measurement callbacks (layer 5) can both ask it."""

from __future__ import annotations

from typing import Any


def logs_this_step(trainer: Any) -> bool:
    """Whether the trainer's loggers write on this step (every ``log_every_n_steps``).

    Per-step values that only the loggers read are worth computing and ``self.log``-ing only then:
    each ``log`` call runs Lightning's result bookkeeping. Lightning has no public accessor; its own
    ``LearningRateMonitor`` and ``ThroughputMonitor`` read this property.
    """
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True))
