"""A torch DataLoader as the stream: batches of one size learn; a short last batch is refused with the fix."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import partime


def loader(drop_last: bool) -> DataLoader:
    """10 samples of 3 features and a class, in batches of 4: two full batches and a last one of 2."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(10, 3, generator=generator), torch.arange(10) % 2)
    return DataLoader(data, batch_size=4, drop_last=drop_last)


def learner() -> partime.Pipeline:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
    return partime.Pipeline(model, [2, 1], executor="inline", loss_fn=nn.CrossEntropyLoss(), optimizer=sgd)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def test_a_dataloader_of_batches_of_one_size_learns_every_batch() -> None:
    batches = loader(drop_last=True)
    with learner() as pipe:
        results = list(pipe.stream(batches))  # (x, y) lists, as the DataLoader collates them
    assert len(batches) == 2
    assert [r.index for r in results] == [0, 1]
    assert all(r.loss is not None and torch.isfinite(torch.as_tensor(r.loss)) for r in results)
    for r, (x, y) in zip(results, batches):
        assert r.output.shape == (4, 2) and torch.equal(r.target, y)


def test_a_short_last_batch_is_refused_with_the_fix_and_uses_up_its_index() -> None:
    with learner() as pipe:
        seen = []
        with pytest.raises(ValueError) as refused:
            for r in pipe.stream(loader(drop_last=False)):
                seen.append(r.index)
        seen += [r.index for r in pipe.flush()]
        assert seen == [0, 1]  # the two full batches learnt
        assert pipe.step(torch.randn(4, 3), torch.zeros(4, dtype=torch.long)) is None
        assert [r.index for r in pipe.flush()] == [3]  # the short batch used up index 2
    message = str(refused.value)
    assert "sample 2 is (2, 3) float32, but the first one was (4, 3) float32" in message
    assert "DataLoader(..., drop_last=True)" in message
    assert "only the first (batch) dimension differs" in message


def test_a_sample_that_differs_elsewhere_gets_no_dataloader_hint() -> None:
    with learner() as pipe:
        pipe.step(torch.randn(4, 3), torch.zeros(4, dtype=torch.long))
        with pytest.raises(ValueError, match=r"sample 1 is \(4, 3\) float64") as refused:
            pipe.step(torch.randn(4, 3, dtype=torch.float64), torch.zeros(4, dtype=torch.long))
        assert "drop_last" not in str(refused.value)
        with pytest.raises(ValueError, match=r"sample 2 is \(2, 3, 1\) float32") as refused:
            pipe.step(torch.randn(2, 3, 1), torch.zeros(2, dtype=torch.long))
        assert "drop_last" not in str(refused.value)
        # a short batch's target, after a sample of the right shape, gets the hint as well
        with pytest.raises(ValueError, match=r"target of sample 3 is \(2,\) int64.*drop_last=True"):
            pipe.step(torch.randn(4, 3), torch.zeros(2, dtype=torch.long))
