"""Traffic planning: topology, flow simulator, ECMP baseline, path planner (docs/planning.md).

Needs networkx and scipy, the ``[plan]`` extra; without them importing this package says so.
"""

from unbroken.extras import require

require("networkx", "plan", "unbroken's traffic planning (unbroken.network)")
require("scipy", "plan", "unbroken's traffic planning (unbroken.network)")
