"""What ``unbroken run`` does beyond restarting: acting on diagnosis verdicts, rolling the job
back to a checkpoint, firing scheduled faults, and re-admitting an isolated node after a
self-check. Pure decisions and thin actions, given what they act on."""
