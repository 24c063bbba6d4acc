"""Lightning's progress bar, told in steps when the run is bounded by steps.

The app trains for ``trainer.max_steps`` with ``max_epochs=-1``; Lightning's rich bar then reads
"Epoch 0/-2" (it prints ``max_epochs - 1``). This bar reads "Epoch 0" and leaves the step count to
the bar itself. Lightning picks the rich bar when ``rich`` is installed and tqdm otherwise; so does
``progress_bar()``.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE


class StepRichProgressBar(RichProgressBar):
    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs < 0:  # bounded by max_steps: no epoch total to show
            text = f"Epoch {current_epoch}"
            return f"{text:{len(self.validation_description)}}"
        return super()._get_train_description(current_epoch)


def progress_bar() -> ProgressBar:
    """The bar Lightning would pick, without the negative epoch total."""
    return StepRichProgressBar() if _RICH_AVAILABLE else TQDMProgressBar()
