"""Communication-driven diagnosis: which rank, node or link is at fault (docs/diagnosis.md)."""
