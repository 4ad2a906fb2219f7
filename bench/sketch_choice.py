"""Which quantile sketch for rollups: speed of the operations the pipeline does, and accuracy.

The pipeline: each rank adds a few points per message to its open window (usually one), the window's
state is written to the Faust changelog after every message (serialise, and deserialise on recovery),
a closed window travels in its Rollup, and the store merges the ranks' windows (64 ranks) and coarser
spans (1,000 windows). Accuracy: p50/p95/p99 of merged sketches against numpy's exact quantiles,
as rank error (|F(estimate) - q|) on heavy-tailed (lognormal) data.
"""

import base64
import time

import numpy as np

W, RANKS, WINDOWS = 50, 64, 1000
QS = (0.5, 0.95, 0.99)
rng = np.random.default_rng(0)
data = rng.lognormal(0, 1.5, size=(WINDOWS, RANKS, W))


def timeit(fn, n):
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


class FastDigest:
    name = "fastdigest 0.12 (t-digest 100, Rust)"
    import fastdigest as m

    def new(self, v): return self.m.TDigest.from_values(list(map(float, v)), max_centroids=100)
    def add1(self, d, x): d.update(x)
    def ser(self, d): return base64.b64encode(d.to_bytes()).decode()
    def de(self, s): return self.m.TDigest.from_bytes(base64.b64decode(s))
    def merge(self, ds):
        out = ds[0].copy()
        for d in ds[1:]:
            out.merge_inplace(d)
        return out
    def q(self, d, q): return d.quantile(q)


class Kll:
    name = "datasketches 5.2 (KLL k=200, C++)"
    import datasketches as m

    def new(self, v): d = self.m.kll_doubles_sketch(200); d.update(np.asarray(v)); return d
    def add1(self, d, x): d.update(x)
    def ser(self, d): return base64.b64encode(d.serialize()).decode()
    def de(self, s): return self.m.kll_doubles_sketch.deserialize(base64.b64decode(s))
    def merge(self, ds):
        out = self.m.kll_doubles_sketch(200)
        for d in ds:
            out.merge(d)
        return out
    def q(self, d, q): return d.get_quantile(q)


class DD:
    name = "ddsketch 3.0 (1% rel., pure Python)"
    import ddsketch as m

    def new(self, v):
        d = self.m.DDSketch(0.01)
        for x in v:
            d.add(float(x))
        return d
    def add1(self, d, x): d.add(x)
    def ser(self, d):
        from ddsketch.pb.proto import DDSketchProto
        return base64.b64encode(DDSketchProto.to_proto(d).SerializeToString()).decode()
    def de(self, s):
        from ddsketch.pb.ddsketch_pb2 import DDSketch as P
        from ddsketch.pb.proto import DDSketchProto
        p = P(); p.ParseFromString(base64.b64decode(s)); return DDSketchProto.from_proto(p)
    def merge(self, ds):
        out = self.m.DDSketch(0.01)
        for d in ds:
            out.merge(d)
        return out
    def q(self, d, q): return d.get_quantile_value(q)


def rank_err(sorted_truth, est, q):
    return abs(np.searchsorted(sorted_truth, est) / len(sorted_truth) - q)


print(f"{'library':38} {'add 1 pt us':>11} {'ser+de us':>9} {'bytes':>6} {'merge64 us':>10} "
      f"{'merge1000 ms':>12} {'rank err p50/p95/p99 (64 ranks)':>32} {'(64k windows)':>20}")
for lib in (FastDigest(), Kll(), DD()):
    try:
        one = lib.new(data[0, 0])
    except Exception as exc:  # noqa: BLE001
        print(lib.name, "failed:", exc); continue
    add = timeit(lambda: lib.add1(one, 1.5), 2000)
    fresh = lib.new(data[0, 1])
    s = lib.ser(fresh)
    try:
        serde = timeit(lambda: lib.de(lib.ser(fresh)), 500)
    except Exception as exc:  # noqa: BLE001
        serde, s = float("nan"), ""
        print(lib.name, "serialisation failed:", exc)
    ranks = [lib.new(data[0, r]) for r in range(RANKS)]
    m64 = timeit(lambda: lib.merge(ranks), 20)
    windows = [lib.new(data[w, 0]) for w in range(WINDOWS)]
    t = time.perf_counter(); lib.merge(windows); m1000 = (time.perf_counter() - t) * 1e3
    truth64 = np.sort(data[0].ravel()); merged = lib.merge(ranks)
    e64 = [rank_err(truth64, lib.q(merged, q), q) for q in QS]
    allw = [lib.new(data[w, r]) for w in range(WINDOWS) for r in range(0, RANKS, 1)] if not isinstance(lib, DD) else \
        [lib.new(data[w, r]) for w in range(200) for r in range(RANKS)]
    truth = np.sort(data[: len(allw) // RANKS].ravel()); big = lib.merge(allw)
    eall = [rank_err(truth, lib.q(big, q), q) for q in QS]
    print(f"{lib.name:38} {add:11.2f} {serde:9.1f} {len(s):6d} {m64:10.1f} {m1000:12.1f} "
          f"{' / '.join(f'{e:.4f}' for e in e64):>32} {' / '.join(f'{e:.4f}' for e in eall):>20}")
