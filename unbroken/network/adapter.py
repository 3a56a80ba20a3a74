"""Turns a plan into what a collective library can be told, and the assignment into JSON.

A library cannot be handed a path, but it chooses the ring order, the QPs per connection and
each QP's UDP source port; with the fabric's hash known, the source port picks the path
(C4P's trick). So every planned share becomes QPs whose source ports hash onto its path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from unbroken.network.ecmp import device_seeds, sport_for_row
from unbroken.network.planner import Plan
from unbroken.network.traffic import PHASES, job_gpus


def assignment_json(plan: Plan) -> dict[str, Any]:
    """Every connection with its port(s), path(s) and share of bytes, by node names."""
    topo, tr = plan.topo, plan.traffic
    rows, weights = plan.choices()
    conns = []
    for c in range(len(tr)):
        paths = []
        for r, w in zip(rows[c].tolist(), weights[c].tolist(), strict=False):
            links = [i for i in plan.cands.paths[c][r].tolist() if i != plan.cands.pad]
            nodes = [topo.links[links[0]][0]] + [topo.links[i][1] for i in links]
            paths.append({"nodes": nodes, "share": round(w, 6)})
        conns.append(
            {
                "job": tr.jobs[int(tr.job[c])].name,
                "phase": PHASES[int(tr.phase[c])],
                "src": topo.gpu_name(int(tr.src[c])),
                "dst": topo.gpu_name(int(tr.dst[c])),
                "bytes": float(tr.nbytes[c]),
                "paths": paths,
            }
        )
    return {"connections": conns, "plan_s": plan.plan_s}


def library_settings(plan: Plan) -> dict[str, Any]:
    """Per job: ring orders (as ranks), QPs per connection and per-QP port and source port.

    Raises:
        ValueError: no source port in the ephemeral range hashes onto a planned path.
    """
    topo, tr = plan.topo, plan.traffic
    seeds = device_seeds(topo)
    rows, weights = plan.choices()
    qps = plan.qps()
    rank_of = [{g: r for r, g in enumerate(job_gpus(topo, job))} for job in tr.jobs]
    out: dict[str, Any] = {}
    for j, job in enumerate(tr.jobs):
        rings = [[rank_of[j][g] for g in order] for (jj, _), order in sorted(tr.rings.items()) if jj == j]
        out[job.name] = {"rings": rings, "qps_per_connection": int(qps[tr.job == j].max()), "connections": []}
    for c in range(len(tr)):
        j, src, dst = int(tr.job[c]), int(tr.src[c]), int(tr.dst[c])
        entry: dict[str, Any] = {
            "phase": PHASES[int(tr.phase[c])],
            "src_rank": rank_of[j][src],
            "dst_rank": rank_of[j][dst],
        }
        paths = plan.cands.paths[c]
        first = topo.links[int(paths[0][0])][0]
        if topo.graph.nodes[first]["kind"] == "gpu":
            entry["nvlink"] = True
        else:
            used: set[int] = set()
            entry["qps"] = []
            for r, w in zip(rows[c].tolist(), weights[c].tolist(), strict=False):
                for _ in range(max(1, int(round(w * qps[c])))):
                    sport = sport_for_row(paths, r, src, dst, seeds, avoid=used)
                    if sport is None:
                        raise ValueError(
                            f"no source port hashes onto the planned path of "
                            f"{topo.gpu_name(src)} -> {topo.gpu_name(dst)}"
                        )
                    used.add(sport)
                    port = topo.graph.nodes[topo.links[int(paths[r][0])][0]]["plane"]
                    entry["qps"].append({"port": int(port), "sport": sport, "share": round(1.0 / qps[c], 6)})
        out[tr.jobs[j].name]["connections"].append(entry)
    top = int(np.max(qps)) if len(qps) else 1
    return {"jobs": out, "env": {"NCCL_IB_QPS_PER_CONNECTION": str(top)}}
