"""optim.wrapper.fused_update: the fused engine's public seam for elementwise updates of other packages."""

from __future__ import annotations

import pytest
import torch

from torchgrad_compat.optim.wrapper import fused_update


def _toward(targets: list[torch.Tensor], sources: list[torch.Tensor], *, rate: torch.Tensor) -> None:
    for t, s in zip(targets, sources, strict=True):
        t.sub_((t - s).mul_(rate))


def _rows(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # 20 rows: two kernel chunks (the last filled up), and a 1-element row that takes the loop.
    return [torch.randn(50 + 7 * i, generator=g) for i in range(19)] + [torch.randn(1, generator=g)]


def test_targets_are_written_as_the_loop_writes_them_and_sources_only_read():
    rate = torch.tensor(0.25)
    targets, sources = _rows(0), _rows(1)
    expected = [t.clone() for t in targets]
    _toward(expected, sources, rate=rate)
    kept_sources = [s.clone() for s in sources]
    versions = [(t._version, s._version) for t, s in zip(targets, sources, strict=True)]
    with torch.no_grad():
        fused_update(_toward, targets, sources, rate=rate)
    assert all(torch.equal(t, e) for t, e in zip(targets, expected, strict=True))
    assert all(torch.equal(s, k) for s, k in zip(sources, kept_sources, strict=True))
    # Autograd sees the targets written in place, and the sources untouched.
    for (tv, sv), t, s in zip(versions, targets, sources, strict=True):
        assert t._version > tv and s._version == sv


def test_a_source_that_does_not_fit_its_target_is_refused_before_anything_changes():
    targets, sources = _rows(0), _rows(1)
    sources[3] = torch.randn(4)
    before = [t.clone() for t in targets]
    with torch.no_grad(), pytest.raises(ValueError, match=r"gradient 3 .* its parameter has 71 elements"):
        fused_update(_toward, targets, sources, rate=torch.tensor(0.5))
    assert all(torch.equal(t, b) for t, b in zip(targets, before, strict=True))
