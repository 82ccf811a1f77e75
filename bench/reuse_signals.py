"""How much a trace's signals predict block reuse: the policy's classes against every signal.

    pip install -e '.[bench]'        # scikit-learn, for the gradient-boosted reference
    taskset -c 0 python bench/reuse_signals.py                       # Mooncake conversation trace
    taskset -c 0 python bench/reuse_signals.py --trace other.jsonl --train 0.5 --tail 2048

The default policy (``advisor.policy.eviction.prefix_value``) ranks a block by ``P(reuse | class)``,
class = (times referenced before capped at 4, last block of its request or not, request
continued a known prefix or not).  Its gap to Belady on a trace is a prediction gap (docs/
BENCHMARKS.md, "The `prefix_value` expert"): this script measures how much better any
predictor built from the signals an online advisor has could do.  For every block
reference it computes, from the requests up to it only:

* the class above, and the first new block after a continued prefix;
* position in the request, from its end, after the known prefix; request length and new
  blocks; the conversation's turn number (1 + the turn of the request whose block ends the
  known prefix); log2 of the gap to that request, in requests and (Mooncake ``timestamp``)
  in ms; log2 of input and output length (Mooncake fields); log2 of the time since the
  block's last reference, in references.

The label is whether the block is referenced again later in the trace.  Both predictors
are fitted on the first ``--train`` share of the requests and scored on the rest, less
the last ``--tail`` requests (whose later references fall beyond the trace's end):

* ours: the class table (the share of each class's training references reused, which is
  what the policy's online estimate converges to);
* reference: scikit-learn's ``HistGradientBoostingClassifier`` on every signal above (by
  default 100 rounds of 7-leaf trees with >= 2,000 references a leaf: of the sizes tried,
  the one that scored best held out; larger trees memorise the training requests).

Printed: ROC AUC of each on the held-out references (all of them, then those of new blocks
of requests that continue nothing, the largest group), the ratio, and the reference's AUC
on its own training set (the gap between the two shows how far an in-sample fit memorises
the file).  Units: AUC in [0, 1], 0.5 = no information.

``--replay 1000,5859,10000,30000`` then asks what a better predictor would be worth in hits.
The policy replays the whole trace at each capacity; the held-out requests' hit rate is
scored, with LRU's and Belady's on the same requests, as the share of the LRU→Belady gap
closed:

* ours: the policy as it ships (its online class estimate);
* reference: the same rule and state, each held-out reference ranked by the boosted model's
  ``P(reuse)`` instead (``prefix_value.simulate(reuse_override=...)``), fitted on the
  training requests with the label "referenced again before the cut" and with "referenced
  again within m × capacity / mean request length requests" for m = 1, 2, 4, 8 (only the
  references whose outcome is known at the cut), the best per capacity
  (chosen on the held-out hits: an optimistic bound, fitted offline, not an online policy);
* oracle: the held-out references ranked by their label itself (1 = referenced again),
  what knowing the future of every block would give the same rule.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._report import Report, add_json_option  # noqa: E402

FEATURES = ("seen", "from_end", "pos", "pos_after_known", "continued", "first_new", "turn",
            "log2_gap_requests", "log2_gap_ms", "log2_input_length", "log2_output_length",
            "new_blocks", "request_blocks", "log2_age_refs")


def _log2(x: float) -> float:
    return math.log2(x) if x > 0 else -1.0


def signals(path: Path, limit: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-reference signals of a Mooncake-format jsonl trace.

    Args:
        path: one JSON object per line with ``hash_ids`` (block ids in prefix order) and,
            when present, ``timestamp`` (ms), ``input_length`` and ``output_length`` (tokens).
        limit: read at most this many requests.

    Returns:
        ``(X, y, req)``: float64 ``[refs, len(FEATURES)]``, int8 ``[refs]`` (1 = the block
        is referenced again later) and int64 ``[refs]`` (the reference's request index).

    Raises:
        ValueError: a line is not JSON or has no ``hash_ids`` list (the message names it).
    """
    rows: list[list[float]] = []
    req: list[int] = []
    seen: dict[int, int] = {}
    last_ref: dict[int, int] = {}
    last_req: dict[int, int] = {}
    turn_of: dict[int, int] = {}
    ts_of: dict[int, float] = {}
    y: list[int] = []
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            try:
                r = json.loads(line)
                h = [int(b) for b in r["hash_ids"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{i + 1}: not a trace record ({exc})") from exc
            n = len(h)
            k = 0
            while k < n and h[k] in last_req:
                k += 1
            cont = k > 1
            turn = turn_of[h[k - 1]] + 1 if cont else 0
            ts = float(r.get("timestamp", 0))
            gap = i - last_req[h[k - 1]] if cont else 0
            gap_ms = ts - ts_of[h[k - 1]] if cont else 0.0
            lin, lout = float(r.get("input_length", 0)), float(r.get("output_length", 0))
            for j, b in enumerate(h):
                ref = len(y)
                prev = last_ref.get(b)
                if prev is not None:
                    y[prev] = 1  # its previous reference was followed by a reuse
                age = ref - prev if prev is not None else 0
                rows.append([min(seen.get(b, 0), 8), min(n - 1 - j, 64), min(j, 256), j - k, float(cont),
                             float(cont and j == k), min(turn, 16), _log2(gap), _log2(gap_ms), _log2(lin),
                             _log2(lout + 1), n - k, n, _log2(age)])
                y.append(0)
                req.append(i)
                last_ref[b] = ref
                seen[b] = seen.get(b, 0) + 1
            for b in h:
                last_req[b] = i
                turn_of[b] = turn
                ts_of[b] = ts
    return np.asarray(rows, dtype=np.float64), np.asarray(y, dtype=np.int8), np.asarray(req, dtype=np.int64)


def class_table_scores(X: np.ndarray, y: np.ndarray, train: np.ndarray, test: np.ndarray) -> np.ndarray:
    """The policy's class predictor: each test reference gets its class's training reuse share.

    The class is the policy's own, :func:`advisor.policy.eviction.prefix_value.reuse_class` with
    the default :class:`~advisor.policy.eviction.prefix_value.PrefixValueSettings` caps (times seen
    before, blocks from the request's end, continued).  A class absent from the training
    references gets the overall share.
    """
    from advisor.policy.eviction.prefix_value import PrefixValueSettings, reuse_class

    s = PrefixValueSettings()
    cols = X[:, [FEATURES.index("seen"), FEATURES.index("from_end"), FEATURES.index("continued")]].astype(np.int64)
    cls = np.fromiter((reuse_class(a, b, c, s.max_seen, s.max_from_end) for a, b, c in cols.tolist()),
                      dtype=np.int64, count=cols.shape[0])
    n_cls = int(cls.max()) + 1
    reused = np.bincount(cls[train], weights=y[train].astype(np.float64), minlength=n_cls)
    total = np.bincount(cls[train], minlength=n_cls).astype(np.float64)
    share = np.where(total > 0, reused / np.maximum(total, 1.0), y[train].mean())
    return share[cls[test]]


def replay(trace_path: Path, X: np.ndarray, y: np.ndarray, req: np.ndarray, cut: int, tail: int,
           capacities: list[int], model_args: dict[str, int],
           limit: int | None = None) -> list[tuple[int, float, float, float, float, str, float]]:
    """Held-out gap closed by the policy and by the policy ranked with the boosted model.

    Args:
        trace_path: the Mooncake-format trace ``X, y, req`` were computed from.
        X, y, req: :func:`signals` of that trace (one row per block reference, in order).
        cut: first held-out request; the scored requests are ``cut .. requests - tail``.
        tail: requests at the end left out of the score.
        capacities: fast-tier capacities in blocks.
        model_args: ``HistGradientBoostingClassifier`` arguments.
        limit: the ``limit`` the signals were read with (requests).

    Returns:
        Per capacity ``(capacity, lru, belady, ours, reference, label, oracle)``: LRU's and
        Belady's hit rates on the scored requests, then the share of the
        LRU→Belady gap closed on the scored requests (1.0 = Belady) by the policy, by the
        policy ranked with the model (its best label named) and with the labels themselves.

    Raises:
        ValueError: the trace has not one reference per row of ``X``.
    """
    from sklearn.ensemble import HistGradientBoostingClassifier

    from advisor.policy.eviction import belady, lru, prefix_value
    from advisor.policy.eviction.compact import compact
    from kvadvisor.evaluate import load_mooncake

    trace = compact(load_mooncake(trace_path, limit))
    if trace.refs != len(y):
        raise ValueError(f"{trace_path}: {trace.refs} references, but {len(y)} rows of signals")
    n_req = trace.requests
    train, test = req < cut, req >= cut
    lens = np.diff(trace.offsets)
    scored = slice(cut, n_req - tail)
    total = float(lens[scored].sum())
    distance = trace.next_use() - req  # requests to the next reference (n_req - req = never)
    mean_len = float(lens[:cut].mean())  # of the training requests
    out = []
    for cap in capacities:
        rate = lambda hits: float(hits[scored].sum()) / total  # noqa: E731
        h_lru, h_opt = rate(lru.simulate(trace, cap)), rate(belady.simulate(trace, cap))
        gap = lambda h: (h - h_lru) / (h_opt - h_lru) if h_opt > h_lru else float("nan")  # noqa: E731
        ours = gap(rate(prefix_value.simulate(trace, cap)))
        best, best_label = -np.inf, ""
        for m in (None, 1, 2, 4, 8):
            if m is None:  # "referenced again", as far as the training requests show it
                label, fit = (req + distance < cut).astype(np.int8), train
            else:  # "within the horizon", on the references whose outcome is known at the cut
                horizon = m * cap / mean_len
                if horizon > cut / 2:
                    continue  # too few training references with a known outcome
                label, fit = (distance <= horizon).astype(np.int8), train & (req < cut - horizon)
            model = HistGradientBoostingClassifier(**model_args).fit(X[fit], label[fit])
            p = np.full(trace.refs, -1.0)
            p[test] = model.predict_proba(X[test])[:, 1]
            g = gap(rate(prefix_value.simulate(trace, cap, reuse_override=p)))
            if g > best:
                best, best_label = g, "ever" if m is None else f"within {m}x"
        p = np.full(trace.refs, -1.0)
        p[test] = y[test]
        oracle = gap(rate(prefix_value.simulate(trace, cap, reuse_override=p)))
        out.append((cap, h_lru, h_opt, ours, float(best), best_label, oracle))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Path(os.environ.get("KVADVISOR_TRACES", "../shared/traces")) / "conversation_trace.jsonl"
    ap.add_argument("--trace", type=Path, default=default, help="Mooncake-format jsonl trace")
    ap.add_argument("--limit", type=int, default=None, help="read at most this many requests")
    ap.add_argument("--train", type=float, default=0.5, help="share of the requests to fit on (0-1)")
    ap.add_argument("--tail", type=int, default=2048, help="requests at the end left out of the test set")
    ap.add_argument("--trees", type=int, default=100, help="boosting rounds of the reference")
    ap.add_argument("--leaves", type=int, default=7, help="leaves per tree of the reference")
    ap.add_argument("--min-leaf", type=int, default=2000,
                    help="references per leaf at least (the regularisation; the best held-out of those tried)")
    ap.add_argument("--replay", default="",
                    help="capacities (blocks, comma-separated): also replay the policy with the model's P(reuse)")
    add_json_option(ap)
    args = ap.parse_args()
    report = Report("reuse_signals", "how well the default policy's reuse classes predict reuse, against a "
                    "gradient-boosted model on every signal")
    try:
        from sklearn.ensemble import HistGradientBoostingClassifier
        from sklearn.metrics import roc_auc_score
    except ImportError:
        print("needs scikit-learn: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    if not 0.0 < args.train < 1.0:
        ap.error("--train must be in (0, 1)")
    t0 = time.perf_counter()
    X, y, req = signals(args.trace, args.limit)
    n_req = int(req[-1]) + 1 if req.size else 0
    cut = int(n_req * args.train)
    train = req < cut
    test = (req >= cut) & (req < n_req - args.tail)
    if not test.any() or y[train].min() == y[train].max():
        print("trace too short for this split", file=sys.stderr)
        return 2
    fresh = test & (X[:, 0] == 0) & (X[:, 1] > 0) & (X[:, 4] == 0)
    ours = class_table_scores(X, y, train, test)
    model_args = {"max_iter": args.trees, "max_leaf_nodes": args.leaves, "min_samples_leaf": args.min_leaf,
                  "random_state": 0}
    model = HistGradientBoostingClassifier(**model_args)
    model.fit(X[train], y[train])
    ref = model.predict_proba(X[test])[:, 1]
    ref_in = model.predict_proba(X[train])[:, 1]
    fresh_in_test = fresh[test]
    print(f"trace {args.trace.name}: {n_req} requests, {len(y)} block references, train = first {cut} requests,"
          f" test = {int(test.sum())} references ({float(y[test].mean()):.3f} reused), {time.perf_counter() - t0:.1f} s")
    print(f"{'held-out ROC AUC':<44} {'ours (classes)':>15} {'reference (all)':>16} {'ratio':>7}")
    a_ours, a_ref = roc_auc_score(y[test], ours), roc_auc_score(y[test], ref)
    print(f"{'every reference':<44} {a_ours:>15.4f} {a_ref:>16.4f} {a_ours / a_ref:>7.3f}")
    auc_ref = "HistGradientBoostingClassifier on every signal, fitted on the training requests"
    report.add("held-out ROC AUC, every reference", a_ours, a_ref, unit="AUC", reference_name=auc_ref, headline=True)
    if fresh_in_test.any() and 0 < y[test][fresh_in_test].mean() < 1:
        f_ours = roc_auc_score(y[test][fresh_in_test], ours[fresh_in_test])
        f_ref = roc_auc_score(y[test][fresh_in_test], ref[fresh_in_test])
        print(f"{'new blocks of requests continuing nothing':<44} {f_ours:>15.4f} {f_ref:>16.4f} "
              f"{(f_ours / f_ref if f_ref else float('nan')):>7.3f}")
        report.add("held-out ROC AUC, new blocks of requests continuing nothing", f_ours, f_ref, unit="AUC",
                   reference_name=auc_ref)
    print(f"reference on its own training set (in-sample): {roc_auc_score(y[train], ref_in):.4f}")
    print("signals:", ", ".join(FEATURES))
    if args.replay:
        caps = [int(c) for c in args.replay.split(",")]
        print(f"held-out gap closed (LRU -> Belady) on requests {cut}..{n_req - args.tail}:")
        print(f"{'capacity':>9} {'LRU':>7} {'Belady':>7} {'ours (online classes)':>22} {'reference (boosted P)':>22} {'ratio':>7}"
              f" {'oracle':>7}  label")
        rows = replay(args.trace, X, y, req, cut, args.tail, caps, model_args, args.limit)
        for cap, h_lru, h_opt, ours_g, ref_g, label, orc in rows:
            print(f"{cap:>9} {h_lru:>7.4f} {h_opt:>7.4f} {ours_g:>22.1%} {ref_g:>22.1%} {ours_g / ref_g:>7.3f} {orc:>7.1%}  {label}")
            report.add(f"held-out gap closed (LRU -> Belady), {cap:,} blocks", ours_g, ref_g, unit="share",
                       reference_name=f"the same rule ranked by the boosted P(reuse) ({label})")
        mean_o, mean_r = np.mean([r[3] for r in rows]), np.mean([r[4] for r in rows])
        print(f"{'mean':>9} {'':>7} {'':>7} {mean_o:>22.1%} {mean_r:>22.1%} {mean_o / mean_r:>7.3f}")
        report.add("held-out gap closed, mean over the capacities", float(mean_o), float(mean_r), unit="share",
                   reference_name="the same rule ranked by the boosted P(reuse)")
    report.extra = {"requests": n_req, "references": len(y), "train_requests": cut,
                    "in_sample_auc_reference": roc_auc_score(y[train], ref_in)}
    report.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
