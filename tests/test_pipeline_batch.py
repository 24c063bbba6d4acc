"""A batch the pipeline (or loss-parallel TP) cannot pass on whole is refused in one line, not unpacked
into something else: these strategies call the model's forward and loss_fn themselves, so a padding
mask or other field of the batch would otherwise be dropped without a word."""

import pytest
import torch

from lightning_par.strategies.pipeline_loop import input_and_target


def test_an_input_target_pair_passes_through():
    x, y = torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long)
    for batch in ((x, y), [x, y]):
        got = input_and_target(batch, "the pipeline")
        assert got[0] is x and got[1] is y


@pytest.mark.parametrize("batch, shape", [
    ({"input_ids": torch.zeros(2, 4), "labels": torch.zeros(2, 4)}, "a dict with keys ['input_ids', 'labels']"),
    ((torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4)), "a tuple of 3"),
    ((torch.zeros(2, 4), [1, 2]), "a tuple of 2"),
    (torch.zeros(2, 4), "a Tensor"),
])
def test_anything_else_is_one_line_naming_what_came(batch, shape):
    with pytest.raises(ValueError) as e:
        input_and_target(batch, "the pipeline")
    msg = str(e.value)
    assert "\n" not in msg and shape in msg and "(input, target) pair" in msg, msg
