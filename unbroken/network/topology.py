"""Cluster fabric: hosts with GPUs and NIC ports, tiered switches, directed links with state.

The graph lives in networkx (so users can inspect or extend it), but every link also gets a
dense integer index: the flow simulator and the planner work on numpy arrays of link indices,
never on the graph, which is what keeps a 4096-GPU plan within seconds.

Paths are valley-free (up to the lowest common tier, then down), which is how a Clos fabric
routes; the set of equal-cost paths between two leaves is cached because ring traffic reuses
the same leaf pairs thousands of times.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
import yaml

UP, DOWN, DEGRADED = "up", "down", "degraded"
GBPS_TO_BYTES = 1e9 / 8


@dataclass(frozen=True)
class Host:
    """A server: ``gpus`` GPUs joined by NVLink, each GPU with one NIC of ``ports`` ports."""

    name: str
    gpus: int
    ports: int


@dataclass
class Topology:
    """A fabric whose links are indexed densely for vectorised simulation.

    Attributes:
        graph: directed graph; nodes carry ``kind`` (gpu, nvswitch, port, switch) and switches
            a ``tier`` (1 leaf, 2 spine, 3 core); edges carry ``idx``.
        hosts: hosts in GPU-numbering order (global GPU id = offset of host + local index).
        state: per directed link index, one of up / down / degraded.
        links: (from, to) node names per directed link index.
    """

    # Capacities are kept as a list while the fabric is built (appending to numpy arrays
    # link by link is quadratic) and exposed as arrays.

    graph: nx.DiGraph
    hosts: list[Host]
    _cap: list[float]
    state: list[str]
    _factor: dict[int, float]
    links: list[tuple[str, str]] = field(default_factory=list)
    _leaf_paths: dict[tuple[str, str], np.ndarray] = field(default_factory=dict, repr=False)
    _up_cache: dict[str, list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict, repr=False)
    _gpu_offsets: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=int), repr=False)

    # ----------------------------------------------------------------- construction
    @classmethod
    def empty(cls) -> Topology:
        return cls(nx.DiGraph(), [], [], [], {})

    def add_host(self, name: str, gpus: int, ports: int, nvlink_gbps: float) -> None:
        """Adds a host, its GPUs, NIC ports and the NVLink switch that joins its GPUs."""
        if gpus < 1 or ports < 1:
            raise ValueError(f"host {name}: needs at least one GPU and one NIC port")
        if any(h.name == name for h in self.hosts):
            raise ValueError(f"host {name} is defined twice")
        self.hosts.append(Host(name, gpus, ports))
        nvs = f"{name}.nvs"
        self.graph.add_node(nvs, kind="nvswitch")
        for g in range(gpus):
            gpu = f"{name}.g{g}"
            self.graph.add_node(gpu, kind="gpu", rail=g)
            self._add_pair(gpu, nvs, nvlink_gbps)
            for p in range(ports):
                self.graph.add_node(f"{gpu}.p{p}", kind="port", rail=g, plane=p, gpu=gpu)

    def add_switch(self, name: str, tier: int) -> None:
        if tier not in (1, 2, 3):
            raise ValueError(f"switch {name}: tier must be 1 (leaf), 2 (spine) or 3 (core)")
        self.graph.add_node(name, kind="switch", tier=tier)

    def connect(self, a: str, b: str, gbps: float) -> None:
        """Adds a full-duplex link (two directed links of ``gbps`` each)."""
        for n in (a, b):
            if n not in self.graph:
                raise ValueError(f"link {a} -- {b}: unknown node {n!r}")
        if gbps <= 0:
            raise ValueError(f"link {a} -- {b}: capacity must be positive, got {gbps}")
        self._add_pair(a, b, gbps)

    def _add_pair(self, a: str, b: str, gbps: float) -> None:
        for u, v in ((a, b), (b, a)):
            if self.graph.has_edge(u, v):
                raise ValueError(f"link {u} -- {v} is defined twice")
            self.graph.add_edge(u, v, idx=len(self.links))
            self.links.append((u, v))
        self._cap += [gbps, gbps]
        self.state += [UP, UP]

    # ----------------------------------------------------------------- queries
    @property
    def capacity_gbps(self) -> np.ndarray:
        return np.asarray(self._cap, dtype=float)

    @property
    def factor(self) -> np.ndarray:
        out = np.ones(len(self._cap))
        for i, f in self._factor.items():
            out[i] = f
        return out

    @property
    def n_links(self) -> int:
        return len(self.links)

    @property
    def n_gpus(self) -> int:
        return sum(h.gpus for h in self.hosts)

    def capacity_bytes(self) -> np.ndarray:
        """Effective capacity in bytes/s per link index (0 for down links)."""
        alive = np.array([s != DOWN for s in self.state], dtype=float)
        return self.capacity_gbps * self.factor * alive * GBPS_TO_BYTES

    def gpu_name(self, gpu: int) -> str:
        host, local = self.locate(gpu)
        return f"{self.hosts[host].name}.g{local}"

    def _offsets(self) -> np.ndarray:
        if len(self._gpu_offsets) != len(self.hosts) + 1:
            self._gpu_offsets = np.concatenate([[0], np.cumsum([h.gpus for h in self.hosts])])
        return self._gpu_offsets

    def locate(self, gpu: int) -> tuple[int, int]:
        """(host index, local GPU index) of a global GPU id."""
        off = self._offsets()
        if not 0 <= gpu < off[-1]:
            raise ValueError(f"GPU id {gpu} out of range: the topology has {off[-1]} GPUs")
        host = int(np.searchsorted(off, gpu, side="right")) - 1
        return host, int(gpu - off[host])

    def host_gpus(self, host: int) -> list[int]:
        start = int(self._offsets()[host])
        return list(range(start, start + self.hosts[host].gpus))

    def host_index(self, name_or_index: str | int) -> int:
        if isinstance(name_or_index, int):
            if not 0 <= name_or_index < len(self.hosts):
                raise ValueError(f"host index {name_or_index} out of range 0..{len(self.hosts) - 1}")
            return name_or_index
        for i, h in enumerate(self.hosts):
            if h.name == name_or_index:
                return i
        raise ValueError(f"unknown host {name_or_index!r}")

    def leaf_of(self, port: str) -> str | None:
        """The switch a NIC port is cabled to, or None if the port is unconnected or down."""
        for nb in self.graph.successors(port):
            if self.graph.nodes[nb].get("kind") == "switch" and self._alive(port, nb):
                return nb
        return None

    def link_index(self, a: str, b: str) -> int:
        if not self.graph.has_edge(a, b):
            raise ValueError(f"no link {a} -> {b}")
        return int(self.graph.edges[a, b]["idx"])

    def _alive(self, a: str, b: str) -> bool:
        return self.state[self.graph.edges[a, b]["idx"]] != DOWN

    # ----------------------------------------------------------------- link state
    def with_failures(self, failures: Iterable[str]) -> Topology:
        """A copy with links or whole switches down.

        Args:
            failures: ``"a:b"`` (the link between nodes a and b, both directions),
                ``"a:b@0.5"`` (degraded to half capacity) or a switch name (all its links).
        """
        out = Topology(self.graph, self.hosts, self._cap, list(self.state), dict(self._factor), self.links)
        for spec in failures:
            out._apply(spec)
        return out

    def _apply(self, spec: str) -> None:
        spec = spec.strip()
        frac: float | None = None
        if "@" in spec:
            spec, f = spec.split("@", 1)
            try:
                frac = float(f)
            except ValueError as exc:
                raise ValueError(f"failure {spec}@{f}: degradation must be a number in (0, 1)") from exc
            if not 0 < frac < 1:
                raise ValueError(f"failure {spec}@{f}: degradation must be in (0, 1)")
        if ":" in spec:
            a, b = spec.split(":", 1)
            idxs = [self.link_index(a, b), self.link_index(b, a)]
        elif spec in self.graph:
            idxs = [d["idx"] for _, _, d in self.graph.out_edges(spec, data=True)]
            idxs += [d["idx"] for _, _, d in self.graph.in_edges(spec, data=True)]
        else:
            raise ValueError(
                f"failure {spec!r}: give a switch name or a link as 'a:b' "
                f"(e.g. one of {self.links[-1][0]}:{self.links[-1][1]})"
            )
        for i in idxs:
            self.state[i] = DEGRADED if frac is not None else DOWN
            self._factor[i] = frac if frac is not None else 1.0

    # ----------------------------------------------------------------- paths
    def leaf_path_links(self, a: str, b: str) -> np.ndarray:
        """All alive valley-free shortest paths from switch a to switch b, as rows of link
        indices (cached: ring traffic asks for the same leaf pairs over and over)."""
        key = (a, b)
        if key not in self._leaf_paths:
            self._leaf_paths[key] = self._valley_free(a, b)
        return self._leaf_paths[key]

    def leaf_paths(self, a: str, b: str) -> list[tuple[str, ...]]:
        """The same paths as node names."""
        return [(a,) + tuple(self.links[i][1] for i in row) for row in self.leaf_path_links(a, b)]

    def _ups(self, node: str) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per number of hops climbed (0..3): the switches reached and the links taken."""
        if node not in self._up_cache:
            levels = [(np.array([node], dtype=object), np.zeros((1, 0), dtype=np.int64))]
            for _ in range(3):
                tops, links = levels[-1]
                nt, nl = [], []
                for t, row in zip(tops.tolist(), links.tolist(), strict=False):
                    tier = self.graph.nodes[t]["tier"]
                    for n in sorted(self.graph.successors(t)):
                        i = self.graph.edges[t, n]["idx"]
                        # links are added in pairs, so i ^ 1 is the way back down
                        if (
                            self.graph.nodes[n].get("tier", 0) > tier
                            and self.state[i] != DOWN
                            and self.state[i ^ 1] != DOWN
                        ):
                            nt.append(n)
                            nl.append(row + [i])
                levels.append(
                    (
                        np.array(nt, dtype=object),
                        np.array(nl, dtype=np.int64).reshape(len(nl), len(row) + 1 if nl else 0),
                    )
                )
            self._up_cache[node] = levels
        return self._up_cache[node]

    def _valley_free(self, a: str, b: str) -> np.ndarray:
        if a == b:
            return np.zeros((1, 0), dtype=np.int64)
        # climb from both ends until the sets of reached switches meet
        for (ta, la), (tb, lb) in zip(self._ups(a), self._ups(b), strict=False):
            if len(ta) == 0 or len(tb) == 0:
                break
            i, j = np.nonzero(ta[:, None] == tb[None, :])
            if len(i):
                return np.hstack([la[i], (lb[j] ^ 1)[:, ::-1]])
        return np.zeros((0, 0), dtype=np.int64)

    def gpu_paths(self, src: int, dst: int) -> list[tuple[str, ...]]:
        """Equal-cost node paths between two GPUs' NIC ports (or NVLink within a host).

        A path starts at a source port and ends at a destination port; all ports and port
        pairs that reach each other with the fewest hops are candidates, so dual-plane NICs
        offer one path set per plane.
        """
        if src == dst:
            raise ValueError(f"connection from GPU {src} to itself")
        (hs, ls), (hd, ld) = self.locate(src), self.locate(dst)
        gs, gd = f"{self.hosts[hs].name}.g{ls}", f"{self.hosts[hd].name}.g{ld}"
        if hs == hd:
            return [(gs, f"{self.hosts[hs].name}.nvs", gd)]
        best: list[tuple[str, ...]] = []
        for ps in range(self.hosts[hs].ports):
            la = self.leaf_of(f"{gs}.p{ps}")
            if la is None:
                continue
            for pd in range(self.hosts[hd].ports):
                port_d = f"{gd}.p{pd}"
                lb = self.leaf_of(port_d)
                if lb is None or not self._alive(lb, port_d):
                    continue
                for mid in self.leaf_paths(la, lb):
                    path = (f"{gs}.p{ps}",) + mid + (port_d,)
                    if not best or len(path) < len(best[0]):
                        best = [path]
                    elif len(path) == len(best[0]):
                        best.append(path)
        if not best:
            raise ValueError(f"no alive path from {gs} to {gd}: the failures disconnect them")
        return best

    def path_links(self, path: tuple[str, ...]) -> tuple[int, ...]:
        edges = self.graph.edges
        return tuple(int(edges[u, v]["idx"]) for u, v in zip(path, path[1:], strict=False))


# --------------------------------------------------------------------- generators
def rail_optimized(
    hosts: int,
    gpus_per_host: int = 8,
    ports: int = 1,
    hosts_per_leaf: int = 16,
    leaves_per_pod: int | None = None,
    spines: int = 8,
    core_per_spine: int = 4,
    oversubscription: float = 1.0,
    port_gbps: float = 400.0,
    nvlink_gbps: float = 3600.0,
) -> Topology:
    """A rail-optimized Clos: GPU r of every host in a block shares the rail-r leaf.

    Dual-port NICs are dual-plane (port p goes to plane p's leaf, planes share nothing above
    the hosts), as in Alibaba HPN. Blocks of ``hosts_per_leaf`` hosts form pods of
    ``leaves_per_pod`` blocks joined by ``spines`` spines per plane; pods are joined by a third
    tier of ``core_per_spine`` cores per spine index (classic fat tree). The leaf tier is
    oversubscribed by ``oversubscription``; the core tier is non-blocking.
    """
    for name, v in (
        ("hosts", hosts),
        ("gpus_per_host", gpus_per_host),
        ("ports", ports),
        ("hosts_per_leaf", hosts_per_leaf),
        ("spines", spines),
    ):
        if v < 1:
            raise ValueError(f"rail_optimized: {name} must be >= 1, got {v}")
    if oversubscription < 1:
        raise ValueError("rail_optimized: oversubscription must be >= 1 (1 = non-blocking)")
    blocks = -(-hosts // hosts_per_leaf)
    per_pod = leaves_per_pod or blocks
    pods = -(-blocks // per_pod)
    topo = Topology.empty()
    for h in range(hosts):
        topo.add_host(f"h{h}", gpus_per_host, ports, nvlink_gbps)
    up_gbps = hosts_per_leaf * port_gbps / (oversubscription * spines)
    for p in range(ports):
        for pod in range(pods):
            for s in range(spines):
                topo.add_switch(f"spine.p{p}.pod{pod}.s{s}", 2)
        for b in range(blocks):
            for r in range(gpus_per_host):
                leaf = f"leaf.p{p}.b{b}.r{r}"
                topo.add_switch(leaf, 1)
                for h in range(b * hosts_per_leaf, min(hosts, (b + 1) * hosts_per_leaf)):
                    topo.connect(f"h{h}.g{r}.p{p}", leaf, port_gbps)
                for s in range(spines):
                    topo.connect(leaf, f"spine.p{p}.pod{b // per_pod}.s{s}", up_gbps)
        if pods > 1:
            core_gbps = per_pod * gpus_per_host * up_gbps / core_per_spine
            for s in range(spines):
                for c in range(core_per_spine):
                    core = f"core.p{p}.s{s}.c{c}"
                    topo.add_switch(core, 3)
                    for pod in range(pods):
                        topo.connect(f"spine.p{p}.pod{pod}.s{s}", core, core_gbps)
    return topo


def from_description(desc: dict[str, Any]) -> Topology:
    """Builds a topology from a parsed YAML/JSON description.

    Either ``{"generator": "rail_optimized", ...keyword arguments...}`` or an explicit
    ``{"hosts": [{"name", "gpus", "ports"}], "switches": [{"name", "tier"}],
    "links": [[a, b, gbps?], ...], "port_gbps": 400, "nvlink_gbps": 3600}``, where a host's
    ports are named ``<host>.g<gpu>.p<port>``. ``failures`` (list) applies link states.
    """
    if not isinstance(desc, dict):
        raise ValueError("topology description must be a mapping")
    desc = dict(desc)
    failures = desc.pop("failures", [])
    if "generator" in desc:
        gen = desc.pop("generator")
        if gen != "rail_optimized":
            raise ValueError(f"unknown topology generator {gen!r}; known: rail_optimized")
        try:
            topo = rail_optimized(**desc)
        except TypeError as exc:
            raise ValueError(f"rail_optimized: {exc}") from exc
    else:
        missing = {"hosts", "switches", "links"} - set(desc)
        if missing:
            raise ValueError(f"topology description lacks {sorted(missing)} " "(or give 'generator: rail_optimized')")
        port_gbps = float(desc.get("port_gbps", 400))
        topo = Topology.empty()
        for h in desc["hosts"]:
            topo.add_host(
                str(h["name"]), int(h.get("gpus", 8)), int(h.get("ports", 1)), float(desc.get("nvlink_gbps", 3600))
            )
        for s in desc["switches"]:
            topo.add_switch(str(s["name"]), int(s["tier"]))
        for link in desc["links"]:
            if not 2 <= len(link) <= 3:
                raise ValueError(f"link {link}: write [a, b] or [a, b, gbps]")
            topo.connect(str(link[0]), str(link[1]), float(link[2]) if len(link) == 3 else port_gbps)
    return topo.with_failures(failures) if failures else topo


def load_topology(path: str | Path) -> Topology:
    """Reads a topology description from a .yaml/.yml/.json file."""
    return from_description(_read_mapping(path))


def _read_mapping(path: str | Path) -> Any:
    text = Path(path).read_text()
    try:
        return json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: not valid {'JSON' if str(path).endswith('.json') else 'YAML'}: {exc}") from exc
