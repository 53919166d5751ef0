import torch

from morion.spec.drafter import PendingTokens


def test_count_and_prefix_slices_do_not_read_the_values():
    reads = []

    def read() -> list[int]:
        reads.append(1)
        return [7, 8, 9]

    pending = PendingTokens(torch.tensor([7, 8, 9]), read)
    assert len(pending) == 3 and bool(pending)
    prefix = pending[:2]
    assert isinstance(prefix, PendingTokens) and len(prefix) == 2 and prefix.on_device.tolist() == [7, 8]
    assert isinstance(pending[:5], PendingTokens) and len(pending[:5]) == 3
    assert not reads
    assert list(prefix) == [7, 8] and pending[-1] == 9 and pending[1:] == [8, 9]
    assert reads
