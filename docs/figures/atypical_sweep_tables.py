"""Emit the docs tables of the atypical-client sweep (docs/atypical_client.md, "the sweep")
from the files the sweep wrote: no figure in those tables is typed by hand.

    clma experiment atypical-client-sweep --out runs/atypical-client-sweep
    python docs/figures/atypical_sweep_tables.py runs/atypical-client-sweep
"""
import json
import sys
from pathlib import Path

import numpy as np

out = Path(sys.argv[1])
doc = json.loads((out / "atypical_client_sweep.json").read_text())
summary, means = doc["summary"], doc["cell_means"]
CELLS = [(10.0, "gaussian_noise"), (10.0, "rotation"), (10.0, "blur"),
         (1.0, "gaussian_noise"), (1.0, "rotation"), (1.0, "blur")]
SHORT = {"gaussian_noise": "noise", "rotation": "rotation", "blur": "blur"}
idx = {(m["regime"], m["score"], m["alpha"], m["perturbation"]): m for m in means}


def f2(v):
    return "-" if v is None else f"{v:.2f}"


print("#### A. Cells meeting each target (of 6), per regime and score\n")
print("| regime | score | top-1 >= 0.8 | separated | persistent | mean AUC z / abs z "
      "| regular p90 abs z early / late (mean of cells) |")
print("|---|---|---|---|---|---|---|")
for r in summary:
    sel = [idx[(r["regime"], r["score"], a, p)] for a, p in CELLS
           if (r["regime"], r["score"], a, p) in idx]
    early = np.mean([m["regular_abs_z_p90_early"] for m in sel])
    late = np.mean([m["regular_abs_z_p90_late"] for m in sel])
    print(f"| {r['regime']} | {r['score']} | {r['cells_at_target']} | {r['cells_separated']} "
          f"| {r['cells_persistent']} | {f2(r['mean_auc'])} / {f2(r['mean_auc_abs'])} "
          f"| {early:.2f} / {late:.2f} |")

def per_cell_table(title, cell):
    """One row per (regime, score), one column per cell; ``cell(m)`` formats a cell mean."""
    print(f"\n#### {title}\n")
    print("| regime | score | " + " | ".join(f"a{a:g} {SHORT[p]}" for a, p in CELLS) + " |")
    print("|---|---|" + "---|" * len(CELLS))
    for r in summary:
        cells = [idx.get((r["regime"], r["score"], a, p)) for a, p in CELLS]
        print(f"| {r['regime']} | {r['score']} | "
              + " | ".join("" if m is None else cell(m) for m in cells) + " |")


def bold_if(flag, text):
    return f"**{text}**" if flag else text


per_cell_table("B. Separation per cell: shifted client's mean abs z / AUC by abs z "
               "(bold: both targets met)",
               lambda m: bold_if(m["separated"],
                                 f"{m['mean_abs_z_shifted']:.2f} / {m['auc_abs_z']:.2f}"))
per_cell_table("C. Signed vs two-sided per cell: top-1 by z / by abs z, mean z",
               lambda m: f"{m['top1_fraction']:.2f} / {m['top1_abs_z_fraction']:.2f}, "
                         f"{m['mean_z_shifted']:.2f}")
per_cell_table("D. Persistence per cell: seeds flagged by round 10 (of 3) / most regular "
               "clients flagged in one federation; mean first round (flagged seeds)",
               lambda m: bold_if(m["persistent"],
                                 f"{m['seeds_persistent_by_10']}/{m['max_regular_persistent']}; "
                                 + ("-" if m["persistent_first_round"] is None
                                    else f"{m['persistent_first_round']:.1f}")))
