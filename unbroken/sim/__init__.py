"""The cluster-scale goodput simulator behind ``unbroken simulate`` (docs/simulation.md).

Needs scipy, the ``[sim]`` extra (plots also matplotlib, ``[report]``); without it importing
this package says so.
"""

from unbroken.extras import require

require("scipy", "sim", "unbroken's goodput simulator (unbroken.sim)")
