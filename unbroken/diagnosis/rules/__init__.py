"""Diagnosis rules, each a pure judgement of telemetry: hangs (``hang``), stragglers
(``straggler``), slow nodes and links (``links``, ``window``), failing NIC ports (``ports``),
training-metric anomalies (``metrics``, ``steptime``), a replica corrupted twice (``suspect``),
and how their thresholds are read off measured distributions (``calibrate``). They import only
``diagnosis``'s base (verdicts, telemetry, robust statistics), never the master."""
