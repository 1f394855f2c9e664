"""Every split along one direction CLMA (improved) makes (a group with one component above
the broken stick, or the leading-component split), with its across/within displacement
cosine, 2-means cluster index and test p-value, and the true drift families of the group's
members (simulation truth): the evidence for the family-ratio level (issue 46,
docs/realistic_drift.md section 8). ``input_ks`` on covariate scenarios; ``--momentum``
as in alpha03_training.py. One JSON line per split appended to OUT:

    OMP_NUM_THREADS=1 python docs/figures/split_ratios.py --momentum 0.3 OUT \\
        label2-iid:0,1,2,3,4 label2-a1:0,1,2,3,4,14 cov-blurrot-a5:0,1,2 ...
"""

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import alpha03_training as A  # noqa: E402

from clma.cohort import cohorter as C  # noqa: E402
from clma.sim.federation import build_federation  # noqa: E402

CAPTURED: list[tuple[int, list[int], str]] = []
CURRENT = {"round": 0}


def _capture() -> None:
    cohort, begin = C.CLMACohorter.cohort, A.FederationEngine.begin_round

    def cohort_and_keep(self, ids, *args, **kwargs):
        res = cohort(self, ids, *args, **kwargs)
        CAPTURED.extend((CURRENT["round"], list(g.members), g.reason) for g in res.groups)
        return res

    def begin_and_count(self, r):
        CURRENT["round"] = r
        return begin(self, r)

    C.CLMACohorter.cohort = cohort_and_keep
    A.FederationEngine.begin_round = begin_and_count


def _number(pattern: str, text: str) -> float | None:
    m = re.search(pattern, text)
    return float(m.group(1)) if m else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("runs", nargs="+", metavar="SCENARIO:SEED,SEED")
    p.add_argument("--momentum", type=float, default=None,
                   help="training.server_momentum (default: the library's)")
    args = p.parse_args()
    _capture()
    with open(args.out, "a", encoding="utf-8") as out:
        for item in args.runs:
            scenario, seeds = item.split(":")
            over = {"drift.detector": "input_ks"} if scenario.startswith("cov-") else {}
            for seed in (int(s) for s in seeds.split(",")):
                CAPTURED.clear()
                try:
                    _, aris = A.run(scenario, seed, 10, over, args.momentum)
                except ValueError as e:  # a Dirichlet draw that never fits
                    print(scenario, seed, "not built:", e, flush=True)
                    continue
                data = A.method_config(A.scenario_config(scenario), "clma_improved",
                                       seed).model_dump()
                for path, value in over.items():
                    section, leaf = path.split(".", 1)
                    data[section][leaf] = value
                data["rounds"] = 10
                fed = build_federation(A.validate_config(data))
                for r, members, reason in CAPTURED:
                    if not reason.startswith(("one component", "leading component")):
                        continue
                    family = fed.drifted_at(r)
                    out.write(json.dumps({
                        "scenario": scenario, "seed": seed, "round": r, "n": len(members),
                        "families": sorted({family.get(c, "none") for c in members}),
                        "ratio": ("apart" if "drift apart" in reason else _number(
                            r"across/within displacement cosine (-?[0-9.]+)", reason)),
                        "cluster_index": _number(r"cluster index ([0-9.]+)", reason),
                        "p": _number(r"p = ([0-9.]+)", reason),
                        "kept": not ("undone" in reason or "not significant" in reason),
                        "reason": reason, "ari": {str(k): v for k, v in aris.items()},
                        "momentum": args.momentum}) + "\n")
                out.flush()
                print(scenario, seed, "done", flush=True)


if __name__ == "__main__":
    main()
