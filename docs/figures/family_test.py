"""An experiment for issue 46 (docs/realistic_drift.md section 8, not adopted): the
cross-direction reconciliation of :class:`clma.cohort.CLMACohorter` (two groups merge when
their across-group displacement cosine is at least ``THRESHOLD`` times their within-group
cosine) applied to EVERY pair of groups the cohorter makes, also two groups of one
direction group (under ``direction_rule = "none"`` all quarantined clients are one direction
group, so the library never compares them). CLMA (improved), the library's default method;
``input_ks`` on covariate scenarios. One JSON line per run (simulation truth) appended to
OUT:

    OMP_NUM_THREADS=1 python docs/figures/family_test.py [--threshold T] OUT SEED SCENARIO...

Section 8 ran it (threshold 0.5, the default here) for seeds 10-14 on label2-iid label2-a5
label2-a1 label2-a05 label2-a03, and for seeds 0-4 on cov-rotnoise-iid cov-blurrot-iid
cov-blurrot-a5; then with ``--threshold 0.75``.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import flows.experiments.realistic_drift as rd
from clma.cohort import cohorter as C

THRESHOLD = 0.5  # the library's reconcile_similarity under the "established" rule


def _reconcile_all_pairs(self, mat, ref, keys, disp=None):
    """CLMACohorter._reconcile without its different-direction-groups restriction."""
    groups = sorted({k for k in keys if k[0] != "no_shift"})
    if len(groups) < 2:
        return {}
    gram = disp if disp is not None else C.displacement_gram(mat, ref,
                                                             block_bytes=self.block_bytes)
    norms = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    safe = np.where(norms > 0.0, norms, 1.0)
    cos = gram / np.outer(safe, safe)
    members = {g: [r for r, k in enumerate(keys) if k == g] for g in groups}

    def within_pairs(rows):
        m = len(rows)
        if m < 2:
            return 0.0, 0
        block = cos[np.ix_(rows, rows)]
        return float(block.sum() - np.trace(block)), m * (m - 1)

    parent = list(range(len(groups)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(len(groups)):
        for j in range(i + 1, len(groups)):
            a, b = members[groups[i]], members[groups[j]]
            across = float(cos[np.ix_(a, b)].mean())
            sa, na = within_pairs(a)
            sb, nb = within_pairs(b)
            within = (sa + sb) / (na + nb) if na + nb else 1.0
            if across > 0.0 and across >= THRESHOLD * within:
                parent[find(j)] = find(i)
    return {g: groups[find(i)] for i, g in enumerate(groups) if find(i) != i}


def main(argv: list[str]) -> int:
    global THRESHOLD
    if argv[:1] == ["--threshold"]:
        THRESHOLD, argv = float(argv[1]), argv[2:]
    out, seed, scenarios = argv[0], int(argv[1]), argv[2:]
    C.CLMACohorter._reconcile = _reconcile_all_pairs
    with open(out, "a", encoding="utf-8") as f:
        for sc in scenarios:
            det = "input_ks" if rd.is_covariate(sc) else None
            r = rd.run_method(sc, "clma_improved", seed, det)
            f.write(json.dumps({"scenario": sc, "seed": seed, "ari": r.ari_per_drift_event,
                                "stationary": r.stationary_final_accuracy,
                                "drifted": r.drifted_final_accuracy}) + "\n")
            f.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
