"""Conformance checks every detector must pass (style guide, item 14).

Each check is a plain function ``check_x(factory, data)``: ``factory()`` builds a fresh detector,
``data`` is a :class:`Data` with normal points for that detector and one unmistakable spike.
``tests/test_detectors.py`` crosses every class in ``rankwatch.stream_processors.detectors.__all__`` with
every function in :data:`CHECKS`.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rankwatch.stream_processors.detectors import Detector

Factory = Callable[[], Detector]

_MUTABLE = (list, dict, set, bytearray, np.ndarray)


@dataclass(frozen=True)
class Data:
    """Points for one detector: ``normal`` is long enough to pass warm-up twice over, ``spike`` is
    a value the detector must score as anomalous once warmed up (NaN for a non-finite detector).

    For a series detector ``normal`` is 1-D and a point is one value. For a cross-rank detector it
    is 2-D (steps x ranks), a point is one row, and the spike replaces the value of ``rank``.
    """

    normal: np.ndarray
    spike: float
    rank: int = 0

    @property
    def at(self) -> int:
        """Where the spike goes: the middle of the second half."""
        return (3 * len(self.normal)) // 4

    def spike_point(self) -> np.ndarray:
        """A batch of one point holding the spike."""
        if self.normal.ndim == 1:
            return np.array([self.spike])
        row = self.normal[self.at].copy()
        row[self.rank] = self.spike
        return row[None, :]

    def spike_of(self, scores: np.ndarray):
        """The spike's own score within the scores of one point."""
        return scores if self.normal.ndim == 1 else scores[self.rank]

    def _nonfinite_points(self) -> np.ndarray:
        if self.normal.ndim == 1:
            return np.array([np.nan, np.inf, -np.inf])
        rows = np.repeat(self.normal[:1], 3, axis=0)
        rows[:, self.rank] = [np.nan, np.inf, -np.inf]
        return rows

    @property
    def with_spike(self) -> np.ndarray:
        """Normal points with the spike in the middle of the second half, plus every non-finite kind."""
        at = self.at
        return np.concatenate([self.normal[:at], self.spike_point(), self.normal[at:], self._nonfinite_points()])

    def split(self, scores: np.ndarray, warmup: int) -> tuple[float, np.ndarray]:
        """The spike's score in ``scores`` of ``with_spike``, and every normal point's score after warm-up."""
        at, n = self.at, len(self.normal)
        normal = np.concatenate([scores[warmup:at].ravel(), scores[at + 1 : n + 1].ravel()])
        if self.normal.ndim == 1:
            return float(scores[at]), normal
        others = np.delete(scores[at], self.rank)
        return float(scores[at, self.rank]), np.concatenate([normal, others])


def _readonly(values: np.ndarray) -> np.ndarray:
    out = np.array(values, dtype=np.float64, copy=True)
    out.setflags(write=False)
    return out


def _state(detector: Detector) -> str:
    """The state as canonical strict JSON, so two states compare as strings."""
    return json.dumps(detector.state_dict(), sort_keys=True, allow_nan=False)


def _warmup(detector: Detector) -> int:
    return int(getattr(detector, "warmup", 0))


def check_score_is_pure(factory: Factory, data: Data) -> None:
    """``score`` changes no state, repeats itself, and scores each point independently of its batch."""
    d = factory()
    d.learn(_readonly(data.normal[: len(data.normal) // 2]))
    before = _state(d)
    x = _readonly(data.with_spike)
    first = d.score(x)
    second = d.score(x)
    assert _state(d) == before, "score() changed the detector's state"
    np.testing.assert_array_equal(first, second)
    one_by_one = np.array([d.score(x[i : i + 1])[0] for i in range(len(x))])
    np.testing.assert_array_equal(first, one_by_one)
    assert _state(d) == before


def check_scores_finite_in_unit_interval(factory: Factory, data: Data) -> None:
    """Scores, from ``score`` and ``update``, are finite floats in [0, 1], one per point, even for NaN/inf."""
    x = _readonly(data.with_spike)
    for scores in (factory().score(x), factory().update(x)):
        scores = np.asarray(scores)
        assert scores.shape == x.shape
        assert np.all(np.isfinite(scores)), scores
        assert np.all((scores >= 0.0) & (scores <= 1.0)), scores


def check_inputs_untouched(factory: Factory, data: Data) -> None:
    """No method writes to the array it was given (read-only inputs would raise) or keeps a view of it."""
    x = data.with_spike.copy()
    expected = x.copy()
    d = factory()
    ro = _readonly(x)
    d.learn(ro)
    d.score(ro)
    d.update(ro)
    d.decide(d.score(ro))
    d.update(x)
    np.testing.assert_array_equal(x, expected)
    state = _state(d)
    x[:] = 123.0  # a detector that kept a view of its input would see this
    assert _state(d) == state, "the detector's state aliases its input"


def check_update_is_score_then_learn(factory: Factory, data: Data) -> None:
    """``update`` equals scoring each point against the state before it, then learning it."""
    x = _readonly(data.with_spike)
    a, b = factory(), factory()
    batched = a.update(x)
    manual = []
    for i in range(len(x)):
        manual.append(b.score(x[i : i + 1])[0])
        b.learn(x[i : i + 1])
    np.testing.assert_array_equal(batched, np.array(manual))
    assert _state(a) == _state(b)


def check_deterministic(factory: Factory, data: Data) -> None:
    """Two detectors built alike and fed alike give identical scores and states."""
    x = _readonly(data.with_spike)
    a, b = factory(), factory()
    np.testing.assert_array_equal(a.update(x), b.update(x))
    assert _state(a) == _state(b)


def check_state_round_trip(factory: Factory, data: Data) -> None:
    """State survives strict JSON; the restored detector scores the rest of the stream identically."""
    x = _readonly(data.with_spike)
    half = len(x) // 2
    original = factory()
    original.update(x[:half])
    state = json.loads(json.dumps(original.state_dict(), allow_nan=False))
    restored = type(original).from_state(state)
    assert type(restored) is type(original)
    assert _state(restored) == _state(original)
    np.testing.assert_array_equal(restored.score(x), original.score(x))
    np.testing.assert_array_equal(restored.update(x[half:]), original.update(x[half:]))
    assert _state(restored) == _state(original)


def check_state_dict_is_a_copy(factory: Factory, data: Data) -> None:
    """Mutating a returned state dict does not reach into the detector."""
    d = factory()
    d.update(_readonly(data.normal))
    before = _state(d)
    state = d.state_dict()
    for value in state.values():
        if isinstance(value, list):
            value.append(1e9)
            value.clear()
    assert _state(d) == before


def check_immutable_defaults(factory: Factory, data: Data) -> None:
    """No constructor default is a mutable container shared between instances."""
    cls = type(factory())
    params = inspect.signature(cls.__init__).parameters
    mutable = {name: p.default for name, p in params.items() if isinstance(p.default, _MUTABLE)}
    assert not mutable, f"mutable defaults: {mutable}"


def check_docstring(factory: Factory, data: Data) -> None:
    """The class documents itself, with a runnable Examples section (style guide, item 13)."""
    doc = inspect.getdoc(type(factory()))
    assert doc and len(doc.split()) >= 5, "missing or trivial docstring"
    assert "Examples" in doc and ">>>" in doc, "no Examples doctest"


def check_warmup_scores_zero(factory: Factory, data: Data) -> None:
    """During warm-up every score is 0, even a spike's; with no warm-up the first point already counts."""
    d = factory()
    warmup = _warmup(d)
    spike = _readonly(data.spike_point())
    if warmup:
        x = _readonly(np.concatenate([data.normal[: warmup - 1], spike]))
        np.testing.assert_array_equal(d.update(x), np.zeros(x.shape))
    # Warm-up over (or none), the next spike is scored.
    assert data.spike_of(d.update(spike)[0]) > 0.0


def check_spike_outscores_normal(factory: Factory, data: Data) -> None:
    """After warm-up, the spike scores above every normal point and is decided anomalous; they are not."""
    d = factory()
    scores = d.update(_readonly(data.with_spike))
    spike, normal = data.split(scores, _warmup(d))
    assert spike > normal.max(), (spike, normal.max())
    assert d.decide(np.array([spike]))[0]
    assert not d.decide(normal).any()


def check_one_side_ignores_the_other(factory: Factory, data: Data) -> None:
    """Told to watch one side (``direction``), a detector flags no move to the other, not even a
    new level that lasts (a sawtooth's reset, for an upward one). Detectors without one pass."""
    d = factory()
    if "direction" not in inspect.signature(type(d).__init__).parameters:
        return
    normal = data.normal if data.normal.ndim == 1 else data.normal[:, data.rank]
    centre = float(np.median(normal))
    side = 1.0 if data.spike > centre else -1.0  # the spike's side is the one this data watches
    watcher = type(d).from_state({**d.state_dict(), "direction": "up" if side > 0 else "down"})
    x = data.normal.copy()
    moved = x[data.at :] if x.ndim == 1 else x[data.at :, data.rank]
    moved *= 0.1 if side > 0 else 50.0  # the data are positive: far off as a ratio too (blowup works on logs)
    flagged = watcher.decide(watcher.update(_readonly(x)))
    assert not np.asarray(flagged).any(), np.flatnonzero(np.asarray(flagged).reshape(len(x), -1).any(axis=1))


CHECKS = [
    check_score_is_pure,
    check_scores_finite_in_unit_interval,
    check_inputs_untouched,
    check_update_is_score_then_learn,
    check_deterministic,
    check_state_round_trip,
    check_state_dict_is_a_copy,
    check_immutable_defaults,
    check_docstring,
    check_warmup_scores_zero,
    check_spike_outscores_normal,
    check_one_side_ignores_the_other,
]

__all__ = ["CHECKS", "Data", *[c.__name__ for c in CHECKS]]
