"""``unbroken agent``: one node of a job across machines, running the replicas its coordinator
assigns, with the relay that carries its ranks' control traffic in one connection."""
