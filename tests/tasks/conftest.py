"""Fixtures shared by the task tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def sampler_spy(monkeypatch):
    """Counts every noise draw of the release path (clma.release.aggregate.sample)."""
    import clma.release.aggregate as agg

    calls = []
    real = agg.sample

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(agg, "sample", spy)
    return calls
