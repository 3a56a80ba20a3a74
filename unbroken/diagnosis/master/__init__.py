"""The diagnosis master: telemetry in, verdicts out (``master``, pure), what it keeps per rank
(``master_state``), and its shell inside the coordinator (``master_service``)."""
